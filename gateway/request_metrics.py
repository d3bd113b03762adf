"""Counts every HTTP response by status code (specfleet_http_responses_total{code}), the error-rate alert's input.

Outermost of the app's own middleware: it sees the 413s of BodyLimit and, as a 500, an exception that escapes
every handler (Starlette's ServerErrorMiddleware turns that into the response further out).
"""

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.metrics import HTTP_RESPONSES


class RequestMetrics:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 0

        async def counting_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
                HTTP_RESPONSES.labels(str(status)).inc()
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        except BaseException:
            if status == 0:
                HTTP_RESPONSES.labels("500").inc()
            raise
