"""GET /v1/jobs/{id}/stream on a short path: the stream served beneath the app's own middleware, without FastAPI's
routing.

A stream stays open for its whole job, and every layer a request passes through stays alive with it: FastAPI's
router, its route and dependency wrappers, three exit stacks, two Request objects, the exception handlers'
wrappers around `send`. In a census of a gateway holding 500 streams those were ~55 of the ~160 objects the
garbage collector tracked for each stream (~105 left), and a gateway that opens 2,000 streams at once walks all
of them in each full collection (`specfleet_gc_pause_seconds`). `StreamShortPath` sits inside the app's middleware (the
response counts, CORS, the body limit) and answers a well-formed request itself:

    GET, the path's job id as the route's pattern, a bearer key that looks like one, Last-Event-ID absent or
    well-formed, no dependency overrides -> the key and the job's owner read in one round trip (auth.read_owned)
    -> the caller's own existing job: its events (gateway/event_stream.py)

Anything else (a refusal to give: 401, 404, 422; another method or path) goes on to FastAPI, which answers it as
it would have, so every refusal is exactly the route's. The route itself stays, for those and for the OpenAPI
schema (routes/jobs.py `stream_job`).
"""

import re
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.auth import read_owned
from gateway.errors import ApiError
from gateway.event_stream import JobEventStream
from gateway.routes.jobs import EVENT_ID_PATTERN, JOB_ID_PATTERN
from shared import api_keys

STREAM_PATH = re.compile(f"/v1/jobs/({JOB_ID_PATTERN})/stream")  # routes/jobs.py: stream_job
LAST_EVENT_ID = re.compile(EVENT_ID_PATTERN)


class StreamShortPath:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "GET":
            match = STREAM_PATH.fullmatch(_route_path(scope))
            response = await _response(scope, match.group(1)) if match is not None else None
            if response is not None:
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _route_path(scope: Scope) -> str:
    """The path below the app's root path (as Starlette's router matches it)."""
    path: str = scope["path"]
    root: str = scope.get("root_path", "")
    return path[len(root) :] if root and path.startswith(root) else path


async def _response(scope: Scope, job_id: str) -> JobEventStream | None:
    """The stream of the caller's own job, or None for FastAPI's path."""
    app: Any = scope["app"]
    if getattr(app, "dependency_overrides", None):
        return None
    secret, after_id = _headers(scope)
    if secret is None or (after_id is not None and LAST_EVENT_ID.fullmatch(after_id) is None):
        return None
    gw = app.state.gateway
    try:
        _, status = await read_owned(gw.store, secret, {"job_id": job_id})
    except ApiError:
        return None
    if status is None:  # no such job: the route's 404
        return None
    return JobEventStream(gw.hub, job_id, after_id or "0-0")


def _headers(scope: Scope) -> tuple[str | None, str | None]:
    """(the bearer's secret when it looks like a key, Last-Event-ID), from the request's first of each."""
    authorization = last_event_id = None
    for name, value in scope["headers"]:
        if name == b"authorization" and authorization is None:
            authorization = value.decode("latin-1")
        elif name == b"last-event-id" and last_event_id is None:
            last_event_id = value.decode("latin-1")
    if authorization is None:
        return None, last_event_id
    scheme, _, secret = authorization.partition(" ")  # as FastAPI's HTTPBearer reads it
    secret = secret.strip()
    if scheme.lower() != "bearer" or not api_keys.looks_like_key(secret):
        return None, last_event_id
    return secret, last_event_id
