"""Server-sent events responses, streamed in the request's own task: a job's events (GET /v1/jobs/{id}/stream, a
streaming submit) and an OpenAI call's chunks (gateway/openai_api.py).

Starlette's StreamingResponse, under a server of ASGI spec < 2.4 (uvicorn's is 2.3), runs every response in an
anyio task group: two more tasks (the body and a disconnect listener), their cancel scopes, contexts and
wrappers. That was ~55 of the ~210 objects the garbage collector tracked for each open stream (a census of a
gateway holding 500 streams), and a gateway that opens 2,000 streams at once walks them all in each full
collection. An `EventStreamResponse` writes its frames in the request's task and listens for the disconnect in
one plain task, which closes the follower's wake-up (gateway/streaming.py `Wake`): the follower ends at its next
wake-up, with no cancellation thrown into the writer.

    send(start) -> for each frame of frames(wake): send(frame) -> send(end) -> background, if any
    listener: receive() until http.disconnect -> wake.close()

A frame is one socket write. A job's stream writes the events one wake-up brought together as one frame, and
the response's end in the write of its last frame (`is_ending`): a job's last step (its last token and `done`)
was three writes, and three wake-ups of its client, and is one.
"""

import asyncio
import logging
from collections.abc import AsyncGenerator, Mapping
from contextlib import aclosing

from starlette.background import BackgroundTask
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from gateway.metrics import SSE_EVENTS, SSE_STREAMS
from gateway.streaming import EventHub, Wake, sse_frame
from shared.schemas import EventType

log = logging.getLogger(__name__)

SSE_EVENTS_BY_TYPE = {t: SSE_EVENTS.labels(t.value) for t in EventType}  # one lookup per type, not per event
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class EventStreamResponse(Response):
    """An event stream; a subclass says what it writes (`frames`)."""

    media_type = "text/event-stream"
    is_ending = False  # set by frames() before it yields the stream's last frame: the response ends in its write

    def __init__(self, headers: Mapping[str, str] | None = None, background: BackgroundTask | None = None) -> None:
        self.status_code = 200
        self.background = background
        self.init_headers({**SSE_HEADERS, **(headers or {})})

    def frames(self, wake: Wake) -> AsyncGenerator[bytes, None]:
        """The stream's frames; they end early once `wake` is closed (the client left)."""
        raise NotImplementedError

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        wake = Wake()
        listener = asyncio.create_task(_close_on_disconnect(receive, wake))
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async with aclosing(self.frames(wake)) as frames:
                async for frame in frames:
                    await send({"type": "http.response.body", "body": frame, "more_body": not self.is_ending})
            if not (wake.is_closed or self.is_ending):
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            listener.cancel()
        if self.background is not None:
            await self.background()


class JobEventStream(EventStreamResponse):
    """A job's events after `after_id`, up to its final one."""

    def __init__(self, hub: EventHub, job_id: str, after_id: str, headers: Mapping[str, str] | None = None) -> None:
        super().__init__(headers)
        self.hub, self.job_id, self.after_id = hub, job_id, after_id

    async def frames(self, wake: Wake) -> AsyncGenerator[bytes, None]:
        SSE_STREAMS.inc()
        try:
            async with aclosing(self.hub.follow_runs(self.job_id, self.after_id, wake)) as runs:
                async for run in runs:
                    for event in run:
                        if event is not None:
                            SSE_EVENTS_BY_TYPE[event.type].inc()
                    last = run[-1]
                    self.is_ending = last is not None and last.type.is_final
                    yield b"".join(sse_frame(event) for event in run)
        finally:
            SSE_STREAMS.dec()


async def _close_on_disconnect(receive: Receive, wake: Wake) -> None:
    """Wait for the client to leave (any request body left is read and dropped), then end its follower."""
    try:
        while (await receive())["type"] != "http.disconnect":
            pass
    except Exception:  # a server whose receive fails has lost the client too
        log.debug("receive failed while streaming; ending the stream", exc_info=True)
    wake.close()
