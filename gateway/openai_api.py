"""The OpenAI-compatible side of the gateway: the served model's name, and one call (submit a
job through the queue, then answer when it finishes or stream its tokens as OpenAI chunks).

Errors on these routes are OpenAI's (gateway/openai_errors.py).
A client that goes away before its job finished (a closed stream, or a dropped non-streaming call) cancels the
job when settings.cancel_on_disconnect, so abandoned requests free the GPU. The job's id is in the
`x-specfleet-job-id` header of every answer: GET /v1/jobs/{id} shows the job behind a call.
"""

import asyncio
import logging
import time
from collections.abc import AsyncGenerator
from contextlib import aclosing

import anyio
from fastapi import Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from starlette.background import BackgroundTask

from gateway import admission
from gateway.auth import Caller
from gateway.cancel_after import HEADER as CANCEL_AFTER
from gateway.cancel_after import with_cancel_after
from gateway.deps import Gateway
from gateway.errors import ApiError
from gateway.event_stream import EventStreamResponse
from gateway.openai_errors import OpenAIError, OpenAIErrorBody
from gateway.openai_stream_logprobs import StreamLogprobs
from gateway.streaming import Wake
from shared import openai_compat as oa
from shared.job_record import job_from_fields
from shared.job_state import ErrorCode, JobStatus
from shared.openai_logprobs import ChatLogprobs, CompletionLogprobs
from shared.schemas import DoneEvent, ErrorEvent, ErrorInfo, EventType, Job, TokenEvent

log = logging.getLogger(__name__)

JOB_ID_HEADER = "x-specfleet-job-id"
DONE_FRAME = b"data: [DONE]\n\n"


# -- one call ------------------------------------------------------------------------------------------------------
def _job_failure(job: Job) -> ApiError:
    """The HTTP error of a job that did not succeed."""
    info = job.error or ErrorInfo(code=job.status.value, message=f"the job {job.status.value}")
    if job.status is JobStatus.EXPIRED:
        return ApiError(503, ErrorCode.EXPIRED, info.message, headers={"Retry-After": "1"})
    if job.status is JobStatus.CANCELLED:
        return ApiError(409, ErrorCode.CANCELLED, info.message)
    if info.code in (ErrorCode.PROMPT_TOO_LONG, ErrorCode.INVALID_REQUEST):
        return ApiError(400, ErrorCode(info.code), info.message, field=info.field)
    if info.code == ErrorCode.TIMEOUT:  # its execution deadline (timeout_s / Cancel-After) passed
        return ApiError(504, ErrorCode.TIMEOUT, info.message)
    return ApiError(500, ErrorCode.ENGINE_ERROR, info.message)


class ChunkStream(EventStreamResponse):
    """A streaming call's chunks (gateway/event_stream.py). A client that leaves before its job finished cancels
    it: the frames do on their way out, and the background task after the stream, should the frames never have
    started."""

    def __init__(self, call: "Call", headers: dict[str, str]) -> None:
        super().__init__(headers, BackgroundTask(call.cancel_if_abandoned))
        self.call = call

    def frames(self, wake: Wake) -> AsyncGenerator[bytes, None]:
        return self.call.frames(wake)


class Call:
    """One OpenAI call: its job, and how the answer is written (a whole object, or chunks)."""

    def __init__(
        self,
        gw: Gateway,
        request: Request,
        body: oa.CompletionRequest | oa.ChatCompletionRequest,
        is_chat: bool,
    ) -> None:
        self.gw = gw
        self.request = request
        self.body = body
        self.is_chat = is_chat
        self.job_id = ""
        self.model = ""
        self.is_finished = False

    async def run(self, caller: Caller, idempotency_key: str | None) -> Response | BaseModel:
        self.model = await self.gw.served_model.check(self.body.model)
        job_request = oa.to_job_request(self.body, self.gw.settings.openai_priority)
        job_request = with_cancel_after(job_request, self.request.headers.get(CANCEL_AFTER))
        admitted = await admission.submit(self.gw, caller, job_request, idempotency_key)
        self.job_id = admitted.submitted.job_id
        headers = {**admitted.headers, JOB_ID_HEADER: self.job_id}
        if self.body.stream:
            return ChunkStream(self, headers)
        job = await self._wait()
        if job.status is not JobStatus.SUCCEEDED:
            error = _job_failure(job)
            error.headers = {**(error.headers or {}), JOB_ID_HEADER: self.job_id}
            raise error
        if isinstance(self.body, oa.ChatCompletionRequest):
            answer: BaseModel = oa.chat_completion_of(job, self.model, self.body.tool_set())
        else:
            answer = oa.completion_of(job, self.model, self.body.prompt_text() if self.body.echo else None)
        return JSONResponse(answer.model_dump(mode="json"), headers=headers)

    async def _wait(self) -> Job:
        """Block until the job is final; a client that leaves meanwhile cancels it, as soon as its connection
        closes (the server's disconnect message, not a poll)."""

        async def final_event() -> None:
            async with aclosing(self.gw.hub.follow(self.job_id)) as events:
                async for event in events:
                    if event is not None and event.type.is_final:
                        return

        async def client_left() -> None:
            # the body was read: what the server still has to tell this call is that its client went away
            while (await self.request.receive())["type"] != "http.disconnect":
                pass

        follower = asyncio.create_task(final_event())
        watcher = asyncio.create_task(client_left())
        try:
            await asyncio.wait({follower, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if follower.done():
                follower.result()
                self.is_finished = True
            else:
                if (error := watcher.exception()) is not None:
                    log.warning("job %s: lost track of its client (%r); taking it as gone", self.job_id, error)
                await self.cancel_if_abandoned()
        finally:
            for task in (follower, watcher):
                if not task.done():
                    task.cancel()
                    try:
                        await task
                    except asyncio.CancelledError:
                        pass
        fields = await self.gw.store.get(self.job_id)
        if fields is None:
            raise ApiError(500, ErrorCode.INTERNAL, "the job vanished")
        return job_from_fields(fields, self.gw.base_url(self.request))

    async def frames(self, wake: Wake) -> AsyncGenerator[bytes, None]:
        """The call's chunks as server-sent events; they end early once `wake` is closed (the client left)."""
        extras = StreamLogprobs(self.body)  # logprobs and echo (gateway/openai_stream_logprobs.py)
        try:
            if self.is_chat:
                yield self._chunk(oa.ChatDelta(role="assistant", content=""))
            if (prompt := extras.opening_echo()) is not None:
                yield self._chunk(prompt)
            async with aclosing(self.gw.hub.follow(self.job_id, wake=wake)) as events:
                async for event in events:
                    if event is None:
                        yield b": keepalive\n\n"
                    elif event.type is EventType.TOKEN:
                        token = TokenEvent.model_validate_json(event.data)
                        if (echoed := extras.echo_with_logprobs(token)) is not None:
                            yield self._chunk(echoed[0], logprobs=echoed[1])
                        logprobs = extras.of(token)
                        if token.text or logprobs is not None:
                            delta = oa.ChatDelta(content=token.text) if self.is_chat else token.text
                            yield self._chunk(delta, logprobs=logprobs)
                    elif event.type is EventType.DONE:
                        done = DoneEvent.model_validate_json(event.data)
                        self.is_finished = True
                        yield self._chunk(
                            oa.ChatDelta() if self.is_chat else "", oa.finish_reason(done.finish_reason)
                        )
                        if self.body.include_usage:
                            usage = oa.usage_of(done.usage.prompt_tokens, done.usage.completion_tokens)
                            yield self._usage_chunk(usage)
                    elif event.type is EventType.ERROR:
                        failed = ErrorEvent.model_validate_json(event.data)
                        self.is_finished = True
                        yield self._error_frame(failed)
            yield DONE_FRAME
        finally:
            if not self.is_finished:
                with anyio.CancelScope(shield=True):
                    await self.cancel_if_abandoned()

    def _chunk(
        self,
        delta: oa.ChatDelta | str,
        finish: oa.FinishReason | None = None,
        logprobs: CompletionLogprobs | ChatLogprobs | None = None,
    ) -> bytes:
        created = int(time.time())
        chunk: BaseModel
        if isinstance(delta, oa.ChatDelta):
            chunk = oa.ChatCompletionChunk(
                id=oa.chat_completion_id(self.job_id),
                created=created,
                model=self.model,
                choices=[
                    oa.ChatChunkChoice(
                        delta=delta, finish_reason=finish, logprobs=logprobs if isinstance(logprobs, ChatLogprobs) else None
                    )
                ],
            )
        else:
            chunk = oa.Completion(
                id=oa.completion_id(self.job_id),
                created=created,
                model=self.model,
                choices=[
                    oa.CompletionChoice(
                        text=delta,
                        finish_reason=finish,
                        logprobs=logprobs if isinstance(logprobs, CompletionLogprobs) else None,
                    )
                ],
            )
        return b"data: " + chunk.model_dump_json(exclude={"usage"}).encode() + b"\n\n"

    def _usage_chunk(self, usage: oa.CompletionUsage) -> bytes:
        chunk: BaseModel
        if self.is_chat:
            chunk = oa.ChatCompletionChunk(
                id=oa.chat_completion_id(self.job_id),
                created=int(time.time()),
                model=self.model,
                choices=[],
                usage=usage,
            )
        else:
            chunk = oa.Completion(
                id=oa.completion_id(self.job_id),
                created=int(time.time()),
                model=self.model,
                choices=[],
                usage=usage,
            )
        return b"data: " + chunk.model_dump_json().encode() + b"\n\n"

    def _error_frame(self, failed: ErrorEvent) -> bytes:
        status = 500 if failed.error.code in (ErrorCode.ENGINE_ERROR, ErrorCode.MAX_DELIVERIES) else 400
        kind = "server_error" if status == 500 else "invalid_request_error"
        body = OpenAIError(
            error=OpenAIErrorBody(
                message=failed.error.message, type=kind, param=failed.error.field, code=failed.error.code
            )
        )
        return b"data: " + body.model_dump_json().encode() + b"\n\n"

    async def cancel_if_abandoned(self) -> None:
        """The client left before the job finished: cancel it (once), when settings say so."""
        if self.is_finished or not self.gw.settings.cancel_on_disconnect:
            return
        self.is_finished = True
        try:
            result = await self.gw.store.cancel(self.job_id)
        except (RedisConnectionError, RedisTimeoutError) as exc:
            log.warning("could not cancel abandoned job %s: %s", self.job_id, exc)
            return
        log.info("client left: job %s cancelled (%s)", self.job_id, result)
