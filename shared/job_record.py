"""The job hash <-> the API's `Job`: how a job is stored in Redis and read back (see shared/lua.py)."""

import json

from pydantic import TypeAdapter
from pydantic_core import from_json

from shared.job_state import JobStatus
from shared.logprobs import TokenLogprob
from shared.schemas import ErrorInfo, Job, JobMetrics, JobOutput, JobUrls, Priority, Usage
from shared.webhook_status import webhook_status_from


def job_urls(base_url: str, job_id: str) -> JobUrls:
    base = f"{base_url.rstrip('/')}/v1/jobs/{job_id}"
    return JobUrls(get=base, stream=f"{base}/stream", cancel=f"{base}/cancel")


def token_ids_csv(token_ids: list[int]) -> str:
    return ",".join(map(str, token_ids))


def parse_token_ids(csv: str | None) -> list[int]:
    return [int(t) for t in csv.split(",")] if csv else []


def _float(value: str | None) -> float | None:
    return float(value) if value else None


_LOGPROBS = TypeAdapter(list[TokenLogprob])


def _logprobs(raw: str | None) -> list[TokenLogprob] | None:
    return _LOGPROBS.validate_json(raw) if raw else None


def job_from_fields(fields: dict[str, str], base_url: str) -> Job:
    """Build the API view of a job from its hash (HGETALL, decoded)."""
    status = JobStatus(fields["status"])
    has_output = status is JobStatus.RUNNING or "text" in fields or "finish_reason" in fields
    prompt_tokens = fields.get("prompt_tokens")
    return Job(
        id=fields["id"],
        status=status,
        priority=Priority(fields["priority"]),
        created_at=float(fields["created_at"]),
        started_at=_float(fields.get("started_at")),
        completed_at=_float(fields.get("completed_at")),
        expires_at=_float(fields.get("expires_at")),
        output=JobOutput(
            text=fields.get("text", ""),
            token_ids=parse_token_ids(fields.get("token_ids")),
            finish_reason=fields.get("finish_reason") or None,
            logprobs=_logprobs(fields.get("logprobs")),
            prompt_logprobs=_logprobs(fields.get("prompt_logprobs")),
        )
        if has_output
        else None,
        error=ErrorInfo.model_validate(from_json(fields["error"])) if fields.get("error") else None,
        usage=Usage(
            prompt_tokens=int(prompt_tokens) if prompt_tokens else None,
            completion_tokens=int(fields.get("completion_tokens") or 0),
            cached_tokens=int(fields["cached_tokens"]) if fields.get("cached_tokens") else None,
        ),
        metrics=JobMetrics.model_validate(from_json(fields["metrics"]))
        if fields.get("metrics")
        else JobMetrics(),
        metadata=json.loads(fields.get("metadata") or "{}"),
        model_version=fields.get("model_version") or None,
        urls=job_urls(base_url, fields["id"]),
        webhook_status=webhook_status_from(fields),
    )
