"""The one error shape, `{"error": {"code", "message"}}`, for every non-2xx answer (never a bare 500)."""

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from starlette.exceptions import HTTPException as StarletteHTTPException

from shared import schemas
from shared.job_state import ErrorCode
from shared.schemas import ErrorInfo, ErrorResponse

log = logging.getLogger(__name__)


class ApiError(Exception):
    def __init__(
        self,
        status_code: int,
        code: ErrorCode,
        message: str,
        *,
        field: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.info = ErrorInfo(code=code, message=message, field=field)
        self.headers = headers


def error_response(status_code: int, info: ErrorInfo, headers: dict[str, str] | None = None) -> JSONResponse:
    body = ErrorResponse(error=info).model_dump(exclude_none=True)
    return JSONResponse(body, status_code=status_code, headers=headers)


ERROR_RESPONSES: dict[int | str, dict[str, object]] = {
    code: {"model": ErrorResponse} for code in (400, 401, 404, 409, 413, 415, 422, 429, 503)
}


def _field_of(loc: tuple[int | str, ...]) -> str:
    parts = [str(p) for p in loc]
    if parts and parts[0] in ("body", "header", "query", "path"):
        parts = parts[1:] if parts[0] == "body" else parts
    return ".".join(parts) or "body"


def first_error(exc: RequestValidationError) -> tuple[tuple[int | str, ...], str]:
    """The first error's location and reason (shared.schemas.first_error). A body that is not JSON is named as the
    body, with where and why parsing stopped (pydantic puts the character's offset in its location)."""
    errors = exc.errors()
    if errors and errors[0].get("type") == "json_invalid":
        loc, ctx = tuple(errors[0].get("loc", ())), errors[0].get("ctx")
        why = (ctx.get("error") if isinstance(ctx, dict) else None) or "JSON decode error"
        where = f" at character {loc[1]}" if len(loc) > 1 else ""
        return ("body",), f"not valid JSON ({why}{where})"
    return schemas.first_error(errors)


def unreadable_body(request: Request, exc: RequestValidationError) -> str | None:
    """Why the body is not read as JSON at all, when its Content-Type says so (curl's `-d` sends a form type;
    FastAPI then validates the raw bytes and said only "Input should be a valid dictionary"): the 415 a client
    can act on. None: the body's own content is at fault. (A Content-Encoding is refused before: body_limit.py.)"""
    errors = exc.errors()
    if not errors or tuple(errors[0].get("loc", ())) != ("body",):
        return None
    content_type = request.headers.get("content-type")
    if content_type is None or is_json_type(content_type):
        return None
    return f"the body must be JSON, sent with Content-Type `application/json` (this request's: `{content_type}`)"


def is_json_type(content_type: str) -> bool:
    """application/json, or a JSON-based type (application/*+json), as FastAPI reads them."""
    media_type = content_type.split(";", 1)[0].strip().lower()
    return media_type == "application/json" or (media_type.startswith("application/") and media_type.endswith("+json"))


async def _api_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ApiError)
    return error_response(exc.status_code, exc.info, exc.headers)


async def _validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    unreadable = unreadable_body(request, exc)
    if unreadable is not None:
        return error_response(415, ErrorInfo(code=ErrorCode.INVALID_REQUEST, message=unreadable, field="body"))
    loc, reason = first_error(exc)
    field = _field_of(loc)
    message = f"{field}: {reason}"
    return error_response(422, ErrorInfo(code=ErrorCode.INVALID_REQUEST, message=message, field=field))


async def http_error_response(request: Request, exc: Exception) -> JSONResponse:
    """Starlette's HTTP errors (no route matched, a 405, a body too large) in this shape (the OpenAI paths' in
    theirs: gateway/openai_errors.py installs the handler that chooses)."""
    assert isinstance(exc, StarletteHTTPException)
    code = ErrorCode.NOT_FOUND if exc.status_code == 404 else ErrorCode.INVALID_REQUEST
    return error_response(
        exc.status_code, ErrorInfo(code=code, message=str(exc.detail)), dict(exc.headers or {})
    )


async def _redis_down(request: Request, exc: Exception) -> JSONResponse:
    log.warning("redis unavailable: %s", exc)
    info = ErrorInfo(code=ErrorCode.UNAVAILABLE, message="the job store is unavailable; retry shortly")
    return error_response(503, info, {"Retry-After": "1"})


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error on %s %s", request.method, request.url.path)
    return error_response(500, ErrorInfo(code=ErrorCode.INTERNAL, message="internal error"))


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, http_error_response)
    app.add_exception_handler(RedisConnectionError, _redis_down)
    app.add_exception_handler(RedisTimeoutError, _redis_down)
    app.add_exception_handler(Exception, _unexpected)
