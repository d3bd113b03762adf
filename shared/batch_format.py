"""The OpenAI Batch line format: validate an input file into job requests; write result lines.

Input line:  {"custom_id": "...", "method": "POST", "url": "/v1/completions" | "/v1/chat/completions" |
              "/v1/responses" | "/v1/jobs", "body": {...}}
Result line: {"id": "batch_req_<job>", "custom_id": "...", "response": {"status_code": 200, "request_id":
              "<job>", "body": {...}} | null, "error": {"code", "message"} | null}

Validation names every bad line (1-based), never stops at the first; blank lines are skipped.
"""

import json
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from shared import openai_compat
from shared.batch_schemas import BatchLineError
from shared.job_state import JobStatus
from shared.openai_response_object import kept_request, request_of, response_of
from shared.openai_responses import RESPONSES_URL, batch_line_request
from shared.reasoning import ReasoningParser
from shared.response_format import CallReading
from shared.schemas import MAX_METADATA_KEYS, Job, JobRequest, Priority

JOBS_URL = "/v1/jobs"
URLS = (openai_compat.COMPLETIONS_URL, openai_compat.CHAT_COMPLETIONS_URL, RESPONSES_URL, JOBS_URL)
MAX_CUSTOM_ID_CHARS = 512
# Job metadata a batch line's job carries (so GET /v1/jobs/{id} says where it came from).
BATCH_ID_KEY, BATCH_LINE_KEY, CUSTOM_ID_KEY = "batch_id", "batch_line", "custom_id"
RESERVED_METADATA = (BATCH_ID_KEY, BATCH_LINE_KEY, CUSTOM_ID_KEY)


class BatchTooLarge(ValueError):
    pass


@dataclass
class BatchLine:
    """One validated input line, stored as json in keys.batch_lines until the batch is finalized."""

    custom_id: str
    url: str
    # at `batch` priority, without the batch's metadata keys yet; None: read back, it does not validate now
    request: JobRequest | None
    model: str | None = None
    stored_request: dict[str, Any] | None = None  # the request as stored, where `request` is None
    calls: CallReading | None = None  # a chat with active tools: how its answer reads as function calls
    # a /v1/responses line: its request but `input` (openai_response_object.kept_request), to write its response
    responses: dict[str, Any] | None = None

    def to_json(self) -> str:
        stored = self.request.model_dump(mode="json", exclude_none=True) if self.request else self.stored_request
        data = {"custom_id": self.custom_id, "url": self.url, "model": self.model, "request": stored}
        if self.calls is not None:
            data["calls"] = self.calls.model_dump(mode="json")
        if self.responses is not None:
            data["responses"] = self.responses
        return json.dumps(data)

    @classmethod
    def from_json(cls, raw: str) -> "BatchLine":
        """A stored line. Its request validated when the batch was made; one that does not now (stored by another
        version of specfleet, a bound tightened since, or changed in Redis) keeps its stored form: its job is
        queued as stored, and the worker fails it naming the field (shared.schemas.stored_request), so the batch
        still ends with a result for every line."""
        data = json.loads(raw)
        calls = CallReading.model_validate(data["calls"]) if data.get("calls") is not None else None
        kept = {"calls": calls, "responses": data.get("responses")}
        try:
            request = JobRequest.model_validate(data["request"])
        except ValidationError:
            return cls(data["custom_id"], data["url"], None, data["model"], stored_request=data["request"], **kept)
        return cls(data["custom_id"], data["url"], request, data["model"], **kept)


def _pydantic_message(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors()[:5]:
        where = ".".join(str(p) for p in err.get("loc", ())) or "body"
        parts.append(f"body.{where}: {err.get('msg', 'invalid')}")
    return "; ".join(parts)


def _job_line(body: dict[str, Any]) -> JobRequest:
    if body.get("webhook") is not None:
        raise ValueError("a batch line cannot carry its own webhook; give the batch one")
    metadata = body.get("metadata") or {}
    if isinstance(metadata, dict):
        if reserved := [k for k in RESERVED_METADATA if k in metadata]:
            raise ValueError(f"metadata keys {', '.join(reserved)} are reserved for batch lines")
        if len(metadata) > MAX_METADATA_KEYS - len(RESERVED_METADATA):
            raise ValueError(
                f"a batch line's job has at most {MAX_METADATA_KEYS - len(RESERVED_METADATA)} metadata keys"
            )
    request = JobRequest.model_validate(body)
    return request.model_copy(update={"priority": Priority.BATCH})


def parse_line(number: int, text: str) -> tuple[BatchLine | None, BatchLineError | None]:
    def bad(code: str, message: str) -> tuple[None, BatchLineError]:
        return None, BatchLineError(line=number, code=code, message=message)

    try:
        data = json.loads(text)
    except ValueError as exc:
        return bad("invalid_json", f"not valid JSON: {exc}")
    if not isinstance(data, dict):
        return bad("invalid_line", "a line is a JSON object")
    if unknown := sorted(set(data) - {"custom_id", "method", "url", "body"}):
        return bad("invalid_line", f"unknown fields: {', '.join(unknown)}")
    custom_id = data.get("custom_id")
    if not isinstance(custom_id, str) or not 1 <= len(custom_id) <= MAX_CUSTOM_ID_CHARS:
        return bad("invalid_custom_id", f"custom_id is a string of 1 to {MAX_CUSTOM_ID_CHARS} characters")
    if data.get("method") != "POST":
        return bad("invalid_method", "method must be POST")
    url = data.get("url")
    if url not in URLS:
        return bad("invalid_url", f"url must be one of {', '.join(URLS)}")
    body = data.get("body")
    if not isinstance(body, dict):
        return bad("invalid_body", "body is a JSON object")
    calls, responses = None, None
    try:
        if url == JOBS_URL:
            request = _job_line(body)
        elif url == RESPONSES_URL:
            asked = batch_line_request(body)
            request = openai_compat.to_job_request(asked.chat_request([]), Priority.BATCH)
            responses = kept_request(asked)
        else:
            request, calls = openai_compat.job_request_for(url, body, Priority.BATCH)
    except ValidationError as exc:
        return bad("invalid_body", _pydantic_message(exc))
    except ValueError as exc:
        return bad("invalid_body", str(exc))
    return BatchLine(custom_id, url, request, openai_compat.model_of(body), calls=calls, responses=responses), None


def parse_batch(
    data: bytes, max_lines: int, endpoint: str | None = None, served_model: str | None = None
) -> tuple[list[BatchLine], list[BatchLineError]]:
    """Every valid line and every bad one (a duplicate custom_id is bad; with `endpoint`, so is a line calling
    another url; with `served_model`, a line naming another model, as the OpenAI routes answer it 404);
    raises BatchTooLarge."""
    lines: list[BatchLine] = []
    errors: list[BatchLineError] = []
    first_seen: dict[str, int] = {}
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        return [], [BatchLineError(line=1, code="invalid_encoding", message=f"the file is not UTF-8: {exc}")]
    numbered = [(n, t) for n, t in enumerate(text.splitlines(), start=1) if t.strip()]
    if len(numbered) > max_lines:
        raise BatchTooLarge(f"the batch has {len(numbered)} lines; at most {max_lines} are allowed")
    if not numbered:
        return [], [BatchLineError(line=1, code="empty_file", message="the batch has no requests")]
    for number, line_text in numbered:
        line, error = parse_line(number, line_text)
        if error is not None:
            errors.append(error)
            continue
        assert line is not None
        if endpoint is not None and line.url != endpoint:
            message = f"url must be {endpoint}, the batch's endpoint"
            errors.append(BatchLineError(line=number, code="invalid_url", message=message))
            continue
        if served_model is not None and line.model not in (None, served_model):
            message = f"the model `{line.model}` does not exist; this fleet serves `{served_model}`"
            errors.append(BatchLineError(line=number, code="model_not_found", message=message))
            continue
        if line.custom_id in first_seen:
            message = f"custom_id {line.custom_id!r} already used on line {first_seen[line.custom_id]}"
            errors.append(BatchLineError(line=number, code="duplicate_custom_id", message=message))
            continue
        first_seen[line.custom_id] = number
        lines.append(line)
    return lines, errors


def result_line(line: BatchLine, job: Job, model: str, reasoning_parser: ReasoningParser = "none") -> dict[str, Any]:
    """The result line of a finished job: `response` when it succeeded (a chat's thinking apart as the route
    answers it: settings.reasoning_parser), else `error`."""
    if job.status is JobStatus.SUCCEEDED:
        if line.url == RESPONSES_URL:
            answer = response_of(job, request_of(line.responses or {}), line.model or model, reasoning_parser)
            body = answer.model_dump(mode="json")
        else:
            body = openai_compat.response_body(line.url, job, line.model or model, line.calls, reasoning_parser)
        response: dict[str, Any] | None = {"status_code": 200, "request_id": job.id, "body": body}
        error = None
    else:
        response = None
        info = job.error
        error = {
            "code": info.code if info else job.status.value,
            "message": info.message if info else f"the job {job.status.value}",
        }
    return {"id": f"batch_req_{job.id}", "custom_id": line.custom_id, "response": response, "error": error}


def unstarted_line(custom_id: str, code: str, message: str) -> dict[str, Any]:
    """The result line of a line that never became a job (its batch was cancelled first)."""
    return {"id": None, "custom_id": custom_id, "response": None, "error": {"code": code, "message": message}}
