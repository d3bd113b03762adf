"""/v1/jobs: submit, list, read, stream (SSE), cancel."""

import asyncio
import re
import time
from contextlib import aclosing
from typing import Annotated

from fastapi import APIRouter, Header, Path, Query, Request, Response
from fastapi.responses import StreamingResponse

from gateway import admission
from gateway.auth import resource_exists
from gateway.cancel_after import with_cancel_after
from gateway.deps import GatewayDep, OwnerDep, SubmitCallerDep
from gateway.errors import ERROR_RESPONSES, ApiError
from gateway.event_stream import JobEventStream
from gateway.fast_submit import FastSubmitRoute
from gateway.listing import unknown_cursor
from gateway.metrics import (
    JOBS_CANCELLED,
    JOBS_SUBMITTED,
    SUBMIT_SECONDS,
)
from gateway.openai_api import JOB_ID_HEADER
from gateway.store import JobStore
from gateway.streaming import EventHub
from gateway.webhook_guard import check_webhook
from shared.job_record import job_from_fields, job_urls
from shared.job_state import ErrorCode, JobStatus
from shared.schemas import Job, JobList, JobRequest
from shared.submit import queue_ttl_s

router = APIRouter(prefix="/v1/jobs", tags=["jobs"], responses=ERROR_RESPONSES)
# the submit: its key is read by the submit's own script call (gateway/auth.py), not by the router's dependency;
# a well-formed request skips FastAPI's per-request dependency solving (gateway/fast_submit.py)
submit_router = APIRouter(prefix="/v1/jobs", tags=["jobs"], responses=ERROR_RESPONSES, route_class=FastSubmitRoute)

JOB_ID_PATTERN = r"[A-Za-z0-9_-]{1,64}"  # also GET /stream's short path (gateway/stream_route.py)
EVENT_ID_PATTERN = r"\d+-\d+"  # a Last-Event-ID: an entry of the job's event stream
JobId = Annotated[str, Path(pattern=f"^{JOB_ID_PATTERN}$")]
_PREFER_WAIT = re.compile(r"(?:^|[,;\s])wait=(\d+(?:\.\d+)?)")


def prefer_wait_s(prefer: str | None, max_wait_s: float) -> float:
    """Seconds asked for by `Prefer: wait=N` (RFC 7240), capped at max_wait_s; 0 without it."""
    match = _PREFER_WAIT.search(prefer or "")
    return min(float(match.group(1)), max_wait_s) if match else 0.0


async def _wait_until_final(hub: EventHub, job_id: str, timeout_s: float) -> None:
    async def final_event() -> None:
        async with aclosing(hub.follow(job_id)) as events:
            async for event in events:
                if event is not None and event.type.is_final:
                    return

    try:
        await asyncio.wait_for(final_event(), timeout_s)
    except TimeoutError:
        pass


async def _load(store: JobStore, job_id: str, base: str) -> Job:
    fields = await store.get(job_id)
    if fields is None:
        raise ApiError(404, ErrorCode.NOT_FOUND, f"no job {job_id}", field="job_id")
    return job_from_fields(fields, base)


def wants_events(accept: str | None) -> bool:
    """`Accept: text/event-stream`: the submit answers with the job's event stream."""
    return accept is not None and "text/event-stream" in accept.lower()


def event_stream(hub: EventHub, job_id: str, after_id: str, headers: dict[str, str]) -> JobEventStream:
    """The job's events after `after_id` as server-sent events, up to its final one."""
    return JobEventStream(hub, job_id, after_id, headers)


@submit_router.post(
    "",
    status_code=202,
    response_model=Job,
    response_model_exclude_none=False,
    responses={
        200: {
            "content": {"text/event-stream": {}},
            "description": "with `Accept: text/event-stream`: the job's events, as GET /v1/jobs/{id}/stream",
        }
    },
)
async def create_job(
    body: JobRequest,
    request: Request,
    gw: GatewayDep,
    caller: SubmitCallerDep,
    idempotency_key: Annotated[str | None, Header(min_length=1, max_length=256)] = None,
    prefer: Annotated[str | None, Header()] = None,
    cancel_after: Annotated[str | None, Header(max_length=64)] = None,
    accept: Annotated[str | None, Header()] = None,
) -> Response:
    """Queue a job: 202 with its `urls`; 200 with the finished job when `Prefer: wait=N` saw it finish; with
    `Accept: text/event-stream`, 200 and the job's events from its first (one request, as a streaming OpenAI
    call; the job's id in `x-specfleet-job-id` and `Location`)."""
    started = time.perf_counter()
    body = with_cancel_after(body, cancel_after)
    store, settings, base = gw.store, gw.settings, gw.base_url(request)
    await check_webhook(body.webhook, settings)
    streams = wants_events(accept)
    admitted = await admission.submit(gw, caller, body, idempotency_key, expect_events=streams)
    submitted = admitted.submitted
    wait_s = prefer_wait_s(prefer, settings.max_wait_s)
    if submitted.is_new:
        JOBS_SUBMITTED.labels(body.priority.value).inc()
    if streams:
        if submitted.is_new:
            SUBMIT_SECONDS.observe(time.perf_counter() - started)
        urls = job_urls(base, submitted.job_id)
        headers = {**admitted.headers, "Location": urls.get, JOB_ID_HEADER: submitted.job_id}
        return event_stream(gw.hub, submitted.job_id, "0-0", headers)
    if wait_s > 0:
        await _wait_until_final(gw.hub, submitted.job_id, wait_s)
    if submitted.is_new and wait_s == 0:
        SUBMIT_SECONDS.observe(time.perf_counter() - started)
        created_at = submitted.created_at or time.time()
        job = Job(
            id=submitted.job_id,
            status=JobStatus.QUEUED,
            priority=body.priority,
            created_at=created_at,
            expires_at=created_at + queue_ttl_s(body.ttl_s, settings),  # as SUBMIT stored it
            metadata=body.metadata,
            urls=job_urls(base, submitted.job_id),
        )
    else:
        job = await _load(store, submitted.job_id, base)
    headers = {**admitted.headers, "Location": job.urls.get}
    return _json(job, 200 if job.status.is_terminal else 202, headers)


def _json(job: Job, status_code: int, headers: dict[str, str]) -> Response:
    """The job as JSON, serialised once by pydantic-core: the hot path skips FastAPI's second validation of a
    model it built itself (the route keeps `response_model` for its schema)."""
    return Response(job.model_dump_json(), status_code=status_code, headers=headers, media_type="application/json")


@router.get("", response_model=JobList)
async def list_jobs(
    request: Request,
    gw: GatewayDep,
    key: OwnerDep,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    after: Annotated[str | None, Query(pattern=f"^{JOB_ID_PATTERN}$")] = None,
    status: JobStatus | None = None,
) -> JobList:
    """The key's jobs, newest first, as GET /v1/jobs/{id} answers each (its newest `jobs_listed_per_key`, while
    their records are kept: result_ttl_s after they end), those in `status` if given; `after` = the last id of
    the previous page."""
    try:
        rows, has_more = await gw.store.page(key.id, limit, after, status)
    except LookupError:
        raise unknown_cursor(str(after), "job") from None
    base = gw.base_url(request)
    data = [job_from_fields(fields, base) for fields in rows]
    return JobList(
        data=data, first_id=data[0].id if data else None, last_id=data[-1].id if data else None, has_more=has_more
    )


@router.get("/{job_id}", response_model=Job)
async def get_job(job_id: JobId, request: Request, gw: GatewayDep) -> Job:
    """The job: status, timestamps, output (partial while running), error, usage, metrics."""
    return await _load(gw.store, job_id, gw.base_url(request))


@router.get(
    "/{job_id}/stream",
    response_model=None,
    response_class=StreamingResponse,  # the schema's: a JobEventStream streams as one
    responses={
        200: {"content": {"text/event-stream": {}}, "description": "token events, then done or error"}
    },
)
async def stream_job(
    job_id: JobId,
    request: Request,
    gw: GatewayDep,
    last_event_id: Annotated[str | None, Header(pattern=f"^{EVENT_ID_PATTERN}$")] = None,
) -> JobEventStream:
    """Server-sent events: `token` events, then `done` or `error`; `Last-Event-ID` resumes just after it."""
    if not resource_exists(request):  # read with the key (gateway/auth.py owned_resources)
        raise ApiError(404, ErrorCode.NOT_FOUND, f"no job {job_id}", field="job_id")
    return event_stream(gw.hub, job_id, last_event_id or "0-0", {})


@router.post("/{job_id}/cancel", response_model=Job)
async def cancel_job(job_id: JobId, request: Request, gw: GatewayDep) -> Job:
    """Cancel a queued or running job (a running one stops within one engine step); 409 once finished."""
    result = await gw.store.cancel(job_id)
    if result == "missing":
        raise ApiError(404, ErrorCode.NOT_FOUND, f"no job {job_id}", field="job_id")
    if result != "ok":
        raise ApiError(409, ErrorCode.CONFLICT, f"job {job_id} already finished: {result}")
    JOBS_CANCELLED.inc()
    return await _load(gw.store, job_id, gw.base_url(request))
