"""The `Cancel-After` header (Replicate's name for an execution deadline): `30`, `30s`, `1m`, `1h30m`, `250ms`.

It sets the job's `timeout_s` (shared/schemas.py: counted from the job's creation); a body's own `timeout_s`
wins. A malformed or non-positive value is a 422 naming the header (OpenAI routes: 400), never a 500.
"""

import re

from gateway.errors import ApiError
from shared.job_state import ErrorCode
from shared.schemas import MAX_TIMEOUT_S, JobRequest

HEADER = "Cancel-After"
_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h)")
_UNIT_S = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration_s(value: str) -> float:
    """Seconds of a Go-style duration (or a bare number of seconds); raises ValueError."""
    text = value.strip().lower()
    if re.fullmatch(r"\d+(?:\.\d+)?", text):
        return float(text)
    if not text or _PART.sub("", text):
        raise ValueError(f"{value!r} is not a duration such as 30s, 5m or 1h30m")
    return sum(float(number) * _UNIT_S[unit] for number, unit in _PART.findall(text))


def with_cancel_after(request: JobRequest, header: str | None) -> JobRequest:
    """The request with `timeout_s` from the header, unless the body set one."""
    if header is None or request.timeout_s is not None:
        return request
    try:
        timeout_s = parse_duration_s(header)
    except ValueError as exc:
        raise ApiError(422, ErrorCode.INVALID_REQUEST, str(exc), field=HEADER) from exc
    if not 0 < timeout_s <= MAX_TIMEOUT_S:
        raise ApiError(422, ErrorCode.INVALID_REQUEST, f"must be over 0 and at most {MAX_TIMEOUT_S:g} s", field=HEADER)
    return request.model_copy(update={"timeout_s": timeout_s})
