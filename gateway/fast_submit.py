"""POST /v1/jobs on a short path: the request's parts handed to the route function directly.

FastAPI solves a route's dependencies anew on every request (the body, four headers, the gateway, the caller
and its bearer scheme), and on the submit route that cost a quarter of the gateway's CPU per submit (py-spy on
`bench e2e`'s submit phase). `FastSubmitRoute` reads the same parts itself for a well-formed request:

    a JSON body that validates as JobRequest (json.loads + model_validate, as FastAPI does), headers within
    their declared limits, no dependency overrides -> the route function, called with them

Anything else (invalid JSON or body, a header out of its limits, another content type) takes FastAPI's own path,
so every refusal is exactly FastAPI's. The route keeps its signature, so the OpenAPI schema is unchanged; the
signature is checked when the route is built. The caller's key is read by the submit's script call either way
(gateway/auth.py, `KeyFirstRoute`).
"""

import inspect
import json
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from gateway.auth import BEARER, KeyFirstRoute, check_unverified_caller, submit_caller
from gateway.errors import ApiError
from shared.schemas import JobRequest

# the route function's parameters, and the limits FastAPI checks on its headers (routes/jobs.py: create_job)
PARAMETERS = ("body", "request", "gw", "caller", "idempotency_key", "prefer", "cancel_after", "accept")
HEADER_MAX_CHARS = {"idempotency-key": 256, "prefer": None, "cancel-after": 64, "accept": None}


def _is_json(content_type: str | None) -> bool:
    return content_type is not None and content_type.split(";", 1)[0].strip().lower() == "application/json"


class FastSubmitRoute(KeyFirstRoute):
    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        fastapi_handler = super().get_route_handler()
        endpoint = self.endpoint
        names = tuple(inspect.signature(endpoint).parameters)
        if names != PARAMETERS:
            raise TypeError(f"FastSubmitRoute serves a function of {PARAMETERS}, not {names}")

        async def fast_handler(request: Request) -> Response:
            arguments = await _arguments(request)
            if arguments is None:
                return await fastapi_handler(request)
            try:
                return await endpoint(**arguments)  # type: ignore[no-any-return]
            except (ApiError, RequestValidationError, StarletteHTTPException):
                await check_unverified_caller(request)  # 401 first, as KeyFirstRoute
                raise

        return fast_handler


async def _arguments(request: Request) -> dict[str, Any] | None:
    """The route function's arguments, or None when FastAPI's own path must handle the request."""
    if getattr(request.app, "dependency_overrides", None):
        return None
    headers = request.headers
    if not _is_json(headers.get("content-type")):
        return None
    values: dict[str, str | None] = {}
    for name, max_chars in HEADER_MAX_CHARS.items():
        value = headers.get(name)
        if value is not None and max_chars is not None and not 1 <= len(value) <= max_chars:
            return None
        values[name] = value
    raw = await request.body()  # a body over the limit raises here, as on FastAPI's path (gateway/body_limit.py)
    try:
        body = JobRequest.model_validate(json.loads(raw))
    except Exception:  # invalid JSON or body (even JSON too deep to parse): FastAPI's path says how
        return None
    caller = await submit_caller(request, await BEARER(request))  # 401: missing or malformed key
    return {
        "body": body,
        "request": request,
        "gw": request.app.state.gateway,
        "caller": caller,
        "idempotency_key": values["idempotency-key"],
        "prefer": values["prefer"],
        "cancel_after": values["cancel-after"],
        "accept": values["accept"],
    }
