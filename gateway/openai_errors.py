"""OpenAI's error shape, `{"error": {"message", "type", "param", "code"}}`, for the OpenAI-compatible routes:
OpenAIRoute converts every error raised in their handlers or dependencies (validation errors are 400, as
OpenAI's; specfleet's own routes keep `{"error": {"code", "message"}}`, gateway/errors.py)."""

import logging
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from starlette.exceptions import HTTPException as StarletteHTTPException

from gateway.auth import KeyFirstRoute
from gateway.errors import ApiError, first_error, http_error_response, unreadable_body

log = logging.getLogger(__name__)

_HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}
_ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 429: "rate_limit_error"}


class OpenAIErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class OpenAIError(BaseModel):
    error: OpenAIErrorBody


OPENAI_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": OpenAIError} for code in (400, 401, 404, 409, 413, 415, 429, 500, 503, 504)
}


def openai_error(
    status_code: int,
    message: str,
    code: str | None,
    param: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    kind = _ERROR_TYPES.get(status_code, "server_error" if status_code >= 500 else "invalid_request_error")
    body = OpenAIError(error=OpenAIErrorBody(message=message, type=kind, param=param, code=code))
    return JSONResponse(body.model_dump(), status_code=status_code, headers=headers)


OPENAI_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/models")  # whose every error is in OpenAI's shape


def http_error(exc: StarletteHTTPException) -> JSONResponse:
    return openai_error(exc.status_code, str(exc.detail), _HTTP_CODES.get(exc.status_code), None, dict(exc.headers or {}))


async def shaped_http_error(request: Request, exc: Exception) -> JSONResponse:
    """The app's handler of Starlette's HTTP errors: under the OpenAI paths (a path no route matches there: a 405,
    a model id with a newline) in OpenAI's shape, elsewhere in specfleet's (gateway/errors.py)."""
    assert isinstance(exc, StarletteHTTPException)
    if request.url.path.startswith(OPENAI_PATHS):
        return http_error(exc)
    return await http_error_response(request, exc)


def _param_of(loc: tuple[Any, ...]) -> str | None:
    parts = [str(p) for p in loc[1:]] if loc and loc[0] == "body" else [str(p) for p in loc]
    return ".".join(parts) or None


def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    unreadable = unreadable_body(request, exc)
    if unreadable is not None:
        return openai_error(415, unreadable, "unsupported_media_type")
    loc, message = first_error(exc)
    param = _param_of(loc)
    return openai_error(400, f"{param}: {message}" if param else message, "invalid_request", param)


class OpenAIRoute(KeyFirstRoute):
    """A route whose every error (its handler's and its dependencies') comes out in OpenAI's shape (a submit's
    unread key is checked first: KeyFirstRoute)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def openai_handler(request: Request) -> Response:
            try:
                return await handler(request)
            except RequestValidationError as exc:
                return validation_error(request, exc)
            except ApiError as exc:  # OpenAI answers 400 where specfleet's own routes answer 422
                return openai_error(
                    400 if exc.status_code == 422 else exc.status_code,
                    exc.info.message,
                    exc.info.code,
                    "prompt" if exc.info.field == "prompt_token_ids" else exc.info.field,  # OpenAI's name of it
                    exc.headers,
                )
            except StarletteHTTPException as exc:
                return http_error(exc)
            except (RedisConnectionError, RedisTimeoutError) as exc:
                log.warning("redis unavailable: %s", exc)
                return openai_error(
                    503,
                    "the job store is unavailable; retry shortly",
                    "unavailable",
                    None,
                    {"Retry-After": "1"},
                )
            except Exception:
                log.exception("unhandled error on %s %s", request.method, request.url.path)
                return openai_error(500, "internal error", "internal_error")

        return openai_handler
