"""Request bodies larger than settings.max_request_bytes (batch files: batch_max_bytes) get 413 before the app
reads them: a declared Content-Length is checked first, a chunked body is counted as it arrives (not for GET
and HEAD, whose routes read no body: a held SSE stream keeps no counting wrappers alive).

A body with a Content-Encoding (gzip, ...) gets 415 with `Accept-Encoding: identity` (RFC 7694): the gateway
decodes none, and read as it is a compressed body failed as "There was an error parsing the body" (400, no
reason) or was counted against the limit in its compressed size."""

from collections.abc import Callable

from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.errors import error_response
from gateway.openai_errors import OPENAI_PATHS, openai_error
from shared.job_state import ErrorCode
from shared.schemas import ErrorInfo
from shared.settings import ServiceSettings

BATCH_PATH = "/v1/batches"
FILES_PATH = "/v1/files"
MULTIPART_OVERHEAD_BYTES = 65536  # form fields and boundaries around an uploaded file
BODILESS_METHODS = ("GET", "HEAD")  # no route of these reads a body: only a declared length is checked


class BodyTooLarge(StarletteHTTPException):
    """Raised from `receive` once a body passes the limit; FastAPI re-raises HTTPExceptions met while reading
    a body, so the route's error handling turns it into a 413 in the route's error shape."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"the request body is larger than {limit} bytes")


class BodyLimit:
    def __init__(self, app: ASGIApp, settings: ServiceSettings) -> None:
        self.app = app
        self.settings = settings

    def limit_for(self, path: str) -> int:
        if path.startswith(BATCH_PATH):
            return max(
                self.settings.max_request_bytes, int(getattr(self.settings, "batch_max_bytes", 0)) + 65536
            )
        if path.startswith(FILES_PATH):
            return max(self.settings.max_request_bytes, self.settings.file_max_bytes + MULTIPART_OVERHEAD_BYTES)
        return self.settings.max_request_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        limit = self.limit_for(path)
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > limit:
            await self._refuse(scope, receive, send, path, limit)
            return
        encoding = dict(scope["headers"]).get(b"content-encoding", b"identity").strip().lower()
        if encoding not in (b"identity", b"") and scope["method"] not in BODILESS_METHODS:
            await self._refuse_encoding(scope, receive, send, path, encoding.decode("latin-1"))
            return
        if scope["method"] in BODILESS_METHODS:  # nothing to count, and no wrappers kept alive by a held stream
            await self.app(scope, receive, send)
            return
        received = 0
        response_started = False

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise BodyTooLarge(limit)
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal response_started
            response_started = response_started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counting_receive, tracking_send)
        except BodyTooLarge:
            if not response_started:
                await self._refuse(scope, receive, send, path, limit)

    @staticmethod
    async def _refuse_encoding(scope: Scope, receive: Receive, send: Send, path: str, encoding: str) -> None:
        message = f"the body is sent with Content-Encoding `{encoding}`; the gateway reads bodies without one"
        headers = {"Accept-Encoding": "identity"}
        response: Callable[[Scope, Receive, Send], object]
        if path.startswith(OPENAI_PATHS):
            response = openai_error(415, message, "unsupported_media_type", None, headers)
        else:
            info = ErrorInfo(code=ErrorCode.INVALID_REQUEST, message=message, field="Content-Encoding")
            response = error_response(415, info, headers)
        await response(scope, receive, send)  # type: ignore[misc]

    @staticmethod
    async def _refuse(scope: Scope, receive: Receive, send: Send, path: str, limit: int) -> None:
        message = f"the request body is larger than {limit} bytes"
        response: Callable[[Scope, Receive, Send], object]
        if path.startswith(OPENAI_PATHS):
            response = openai_error(413, message, ErrorCode.TOO_LARGE.value)
        else:
            response = error_response(413, ErrorInfo(code=ErrorCode.TOO_LARGE, message=message))
        await response(scope, receive, send)  # type: ignore[misc]
