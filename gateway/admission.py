"""One way in for every job an API call creates (POST /v1/jobs, /v1/completions, /v1/chat/completions):

    size limits (settings) -> model context (413) -> the caller's key (401) -> the key's token limit (413)
    -> the key's limits (429) -> SUBMIT with the key as owner

The Idempotency-Key is scoped to the key (one tenant's key never finds another tenant's job). The key lookup, the
limits and the SUBMIT run as ONE script (AUTH_ADMIT_SUBMIT, shared/lua.py): a job admitted but not created (queue
full, idempotent replay) gives its reservation back in the same script.
"""

from dataclasses import dataclass

from gateway.auth import Caller, key_of
from gateway.deps import Gateway
from gateway.errors import ApiError
from gateway.metrics import JOBS_REJECTED
from gateway.rate_limit import estimate_tokens
from gateway.store import IdempotencyConflict, JobStore, QueueFull, Submitted
from shared import logs
from shared.job_state import ErrorCode
from shared.schemas import JobRequest
from shared.submit import new_job_id


@dataclass
class Admitted:
    submitted: Submitted
    headers: dict[str, str]  # x-ratelimit-* for the response


def prompt_chars(request: JobRequest) -> int:
    """The prompt's size against settings.max_prompt_chars (token ids count one each: never more than their text)."""
    if request.prompt is not None:
        return len(request.prompt)
    if request.prompt_token_ids is not None:
        return len(request.prompt_token_ids)
    return sum(len(m.content) for m in request.messages or [])


def reserved_tokens(request: JobRequest) -> int:
    """The key's tokens reserved at submit: a tokenized prompt's own count, a text's estimate; + max_tokens."""
    if request.prompt_token_ids is not None:
        return len(request.prompt_token_ids) + request.max_tokens
    return estimate_tokens(prompt_chars(request), request.max_tokens)


def prompt_field(request: JobRequest) -> str:
    """The field that holds the request's prompt."""
    if request.prompt is not None:
        return "prompt"
    return "prompt_token_ids" if request.prompt_token_ids is not None else "messages"


def check_sizes(request: JobRequest, gw: Gateway) -> None:
    """The settings' caps on max_tokens and prompt length, and text that can be encoded (JSON may carry a lone
    surrogate, `\\ud800`, which no tokenizer or Redis can take), before any tokenizer or Redis work."""
    settings = gw.settings
    if request.max_tokens > settings.max_tokens_limit:
        raise ApiError(
            422,
            ErrorCode.INVALID_REQUEST,
            f"max_tokens: at most {settings.max_tokens_limit}",
            field="max_tokens",
        )
    texts = [request.prompt or "", *(m.content for m in request.messages or []), *request.stop]
    try:
        for text in texts:
            text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ApiError(
            422, ErrorCode.INVALID_REQUEST, "the text is not valid Unicode (a lone surrogate)", field="prompt"
        ) from exc
    if prompt_chars(request) > settings.max_prompt_chars:
        field = prompt_field(request)
        raise ApiError(
            413,
            ErrorCode.PROMPT_TOO_LONG,
            f"{field}: at most {settings.max_prompt_chars} {'token ids' if request.prompt_token_ids else 'characters'}",
            field=field,
        )


async def submit(
    gw: Gateway,
    caller: Caller,
    request: JobRequest,
    idempotency_key: str | None,
    expect_events: bool = False,
    counts_request: bool = True,
) -> Admitted:
    """Check, admit and queue one job for the caller's key -> the job (or the earlier one of the same
    Idempotency-Key). expect_events: the caller will stream the job's events (the hub holds them from the start,
    gateway/streaming.py EventHub.expect). counts_request False: the job is another of a call that counted
    against the key's requests per minute already (an OpenAI call's choices and prompts are one request, as
    OpenAI counts them; each job still counts its tokens and its concurrency slot)."""
    check_sizes(request, gw)
    await gw.prompt_limit.check(request)
    cost = reserved_tokens(request)
    job_id = new_job_id(gw.store.tenant_partition(caller.digest))  # the tenant's partition (shared/keys.py)
    if expect_events:
        gw.hub.expect(job_id)
    # ONE round trip: the key, its limits, then the job (not created: its reservation is given back in the script)
    answer = await gw.store.auth_admit_submit(request, caller.digest, idempotency_key, job_id, cost, counts_request)
    caller.is_read = True
    key = key_of(answer.key_fields)  # 401: unknown or revoked
    if answer.verdict == "too_large":
        raise ApiError(
            413,
            ErrorCode.TOO_LARGE,
            f"this request may use {cost} tokens (prompt estimate + max_tokens), more than this key's "
            f"limit of {key.tokens_per_min} tokens per {gw.settings.rate_limit_period_s:g}s",
            field="max_tokens",
        )
    decision = gw.limiter.decision(key, answer.decision)
    if answer.verdict == "refused":
        JOBS_REJECTED.labels(f"rate_limit_{decision.refused_by}").inc()
        raise ApiError(
            429,
            ErrorCode.RATE_LIMITED,
            f"rate limit reached ({decision.refused_by}); retry after {decision.retry_after_s}s",
            headers=decision.headers,
        )
    try:
        submitted = JobStore.submitted_of(request, answer.result)
    except IdempotencyConflict as exc:
        JOBS_REJECTED.labels("idempotency_conflict").inc()
        raise ApiError(422, ErrorCode.CONFLICT, str(exc), field="Idempotency-Key") from exc
    except QueueFull as exc:
        JOBS_REJECTED.labels("queue_full").inc()
        headers = {"Retry-After": str(gw.settings.retry_after_s)}
        raise ApiError(503, ErrorCode.QUEUE_FULL, str(exc), field="priority", headers=headers) from exc
    logs.JOB_ID.set(submitted.job_id)  # the rest of this request logs about this job
    return Admitted(submitted, decision.headers)
