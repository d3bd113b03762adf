"""The OpenAI-compatible side of the gateway: one call (submit a job a choice through the queue, then answer
when they finish or stream their tokens as OpenAI chunks, each naming its choice).

Errors on these routes are OpenAI's (gateway/openai_errors.py).
A client that goes away before its jobs finished (a closed stream, or a dropped non-streaming call) cancels them
when settings.cancel_on_disconnect, so abandoned requests free the GPU. The jobs' ids are in the
`x-specfleet-job-id` header of every answer (comma-separated): GET /v1/jobs/{id} shows a job behind a call.
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
from gateway.openai_stream_chat import ChoiceText
from gateway.openai_stream_logprobs import StreamLogprobs
from gateway.streaming import Event, Wake
from shared import openai_compat as oa
from shared.job_record import job_from_fields
from shared.job_state import ErrorCode, JobStatus
from shared.openai_logprobs import ChatLogprobs, CompletionLogprobs
from shared.schemas import DoneEvent, ErrorEvent, ErrorInfo, EventType, Job, JobRequest, TokenEvent, Usage

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
    """A streaming call's chunks (gateway/event_stream.py). A client that leaves before its jobs finished cancels
    them: the frames do on their way out, and the background task after the stream, should the frames never have
    started."""

    def __init__(self, call: "Call", headers: dict[str, str]) -> None:
        super().__init__(headers, BackgroundTask(call.cancel_if_abandoned))
        self.call = call

    def frames(self, wake: Wake) -> AsyncGenerator[bytes, None]:
        return self.call.frames(wake)


class Call:
    """One OpenAI call: its jobs (one a choice, `n`), and how the answer is written (a whole object, or chunks)."""

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
        self.job_ids: list[str] = []  # by choice: prompt by prompt, `n` each
        # by choice, the request of its prompt (completions: one a prompt; its echo is that prompt)
        self.bodies: list[oa.CompletionRequest | oa.ChatCompletionRequest] = []
        self.unfinished: set[str] = set()  # jobs whose final event this call has not seen (cancelled if it leaves)
        self.model = ""

    @property
    def job_id(self) -> str:
        """The first choice's job: the answer's id."""
        return self.job_ids[0]

    async def run(self, caller: Caller, idempotency_key: str | None) -> Response | BaseModel:
        self.model = await self.gw.served_model.check(self.body.model)
        headers = await self._submit(caller, self._job_requests(), idempotency_key)
        if self.body.stream:
            return ChunkStream(self, headers)
        jobs = await self._wait()
        for job in jobs:
            if job.status is not JobStatus.SUCCEEDED:
                error = _job_failure(job)
                error.headers = {**(error.headers or {}), JOB_ID_HEADER: headers[JOB_ID_HEADER]}
                raise error
        n = self.body.num_choices
        if isinstance(self.body, oa.ChatCompletionRequest):
            reading, parser = self.body.call_reading(), self.gw.settings.reasoning_parser
            answer: BaseModel = oa.merged([oa.chat_completion_of(job, self.model, reading, parser) for job in jobs], n)
        else:
            answers = [
                oa.completion_of(job, self.model, oa.echoed_prompt(body, job.output.prompt_logprobs if job.output else None))
                for job, body in zip(jobs, self.bodies, strict=True)
                if isinstance(body, oa.CompletionRequest)
            ]
            answer = oa.merged(answers, n)
        return JSONResponse(answer.model_dump(mode="json"), headers=headers)

    def _job_requests(self) -> list[JobRequest]:
        """The call's jobs: one a choice of each prompt (`bodies` says whose)."""
        bodies = self.body.one_per_prompt() if isinstance(self.body, oa.CompletionRequest) else [self.body]
        requests: list[JobRequest] = []
        for body in bodies:
            job_request = oa.to_job_request(body, self.gw.settings.openai_priority)
            job_request = with_cancel_after(job_request, self.request.headers.get(CANCEL_AFTER))
            requests += oa.choice_requests(job_request, self.body.num_choices)
            self.bodies += [body] * self.body.num_choices
        return requests

    async def _submit(self, caller: Caller, requests: list[JobRequest], idempotency_key: str | None) -> dict[str, str]:
        """Queue a job a choice -> the answer's headers (the jobs' ids, comma-separated, in `x-specfleet-job-id`).
        The submits go together (one pipelined write: gateway/redis_batch.py), in choice order. A choice refused
        (a limit, a full queue) refuses the call: the choices queued are cancelled. With an Idempotency-Key,
        choice i > 0 takes `<key>:<i>`, so a retry finds every choice's job."""
        keys = [f"{idempotency_key}:{i}" if i and idempotency_key is not None else idempotency_key
                for i in range(len(requests))]  # fmt: skip
        results = await asyncio.gather(
            *(admission.submit(self.gw, caller, job_request, key, counts_request=i == 0)  # the call: one request
              for i, (job_request, key) in enumerate(zip(requests, keys, strict=True))),
            return_exceptions=True,
        )
        admitted = [result for result in results if not isinstance(result, BaseException)]
        self.job_ids = [one.submitted.job_id for one in admitted]
        if refused := [result for result in results if isinstance(result, BaseException)]:
            with anyio.CancelScope(shield=True):
                await self._cancel(self.job_ids, "another choice was refused")
            raise refused[0]
        self.unfinished = set(self.job_ids)
        return {**admitted[-1].headers, JOB_ID_HEADER: ",".join(self.job_ids)}  # the last: the newest x-ratelimit-*

    async def _wait(self) -> list[Job]:
        """Block until every choice's job is final; a client that leaves meanwhile cancels them, as soon as its
        connection closes (the server's disconnect message, not a poll)."""

        async def final_event(job_id: str) -> None:
            async with aclosing(self.gw.hub.follow(job_id)) as events:
                async for event in events:
                    if event is not None and event.type.is_final:
                        self.unfinished.discard(job_id)
                        return

        async def client_left() -> None:
            # the body was read: what the server still has to tell this call is that its client went away
            while (await self.request.receive())["type"] != "http.disconnect":
                pass

        async def all_final() -> None:
            await asyncio.gather(*(final_event(job_id) for job_id in self.job_ids))

        follower = asyncio.create_task(all_final())
        watcher = asyncio.create_task(client_left())
        try:
            await asyncio.wait({follower, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if follower.done():
                follower.result()
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
        return await self.jobs()

    async def jobs(self) -> list[Job]:
        """The call's jobs as they stand, by choice."""
        records = await asyncio.gather(*(self.gw.store.get(job_id) for job_id in self.job_ids))
        if any(fields is None for fields in records):
            raise ApiError(500, ErrorCode.INTERNAL, "the job vanished")
        base = self.gw.base_url(self.request)
        return [job_from_fields(fields, base) for fields in records if fields is not None]

    async def frames(self, wake: Wake) -> AsyncGenerator[bytes, None]:
        """The call's chunks as server-sent events, each naming its choice; they end early once `wake` is closed
        (the client left)."""
        extras = [StreamLogprobs(body) for body in self.bodies]  # logprobs and echo (openai_stream_logprobs.py)
        reading = self.body.call_reading() if isinstance(self.body, oa.ChatCompletionRequest) else None
        parser = self.gw.settings.reasoning_parser
        texts = (  # a chat choice's thinking apart, its content as text or calls (openai_stream_chat.py)
            [ChoiceText(parser, reading, job_id) for job_id in self.job_ids]
            if self.is_chat and (reading is not None or parser != "none") else None
        )  # fmt: skip
        usages: list[Usage | None] = [None] * len(self.job_ids)
        try:
            for choice, extra in enumerate(extras):
                if self.is_chat:  # an answer that may be a call opens without content, as OpenAI's
                    yield self._chunk(choice, oa.ChatDelta(role="assistant", content=None if reading else ""))
                if (prompt := extra.opening_echo()) is not None:
                    yield self._chunk(choice, prompt)
            async with aclosing(self._events(wake)) as events:
                async for choice, event in events:
                    if event is None:
                        yield b": keepalive\n\n"
                    elif event.type is EventType.TOKEN:
                        token = TokenEvent.model_validate_json(event.data)
                        if (echoed := extras[choice].echo_with_logprobs(token)) is not None:
                            yield self._chunk(choice, echoed[0], logprobs=echoed[1])
                        logprobs = extras[choice].of(token)
                        if texts is not None:
                            deltas = texts[choice].on_text(token.text) if token.text else []
                            if logprobs is not None and not deltas:  # held text: its logprobs go now
                                deltas = [oa.ChatDelta()]
                            for i, piece in enumerate(deltas):  # the token's logprobs ride its last delta
                                yield self._chunk(choice, piece, logprobs=logprobs if i == len(deltas) - 1 else None)
                        elif token.text or logprobs is not None:
                            delta = oa.ChatDelta(content=token.text) if self.is_chat else token.text
                            yield self._chunk(choice, delta, logprobs=logprobs)
                    elif event.type is EventType.DONE:
                        done = DoneEvent.model_validate_json(event.data)
                        self.unfinished.discard(self.job_ids[choice])
                        usages[choice] = done.usage
                        reason = oa.finish_reason(done.finish_reason)
                        if texts is not None:
                            last, reason = texts[choice].on_done(reason)
                            for piece in last:
                                yield self._chunk(choice, piece)
                        yield self._chunk(choice, oa.ChatDelta() if self.is_chat else "", reason)
                    elif event.type is EventType.ERROR:
                        failed = ErrorEvent.model_validate_json(event.data)
                        self.unfinished.discard(self.job_ids[choice])
                        yield self._error_frame(failed)
                        await self._cancel(sorted(self.unfinished), "another choice failed")  # the call failed
                        self.unfinished = set()
                        break
            if self.body.include_usage and all(usage is not None for usage in usages):
                yield self._usage_chunk(oa.call_usage([u for u in usages if u is not None], self.body.num_choices))
            yield DONE_FRAME
        finally:
            if self.unfinished:
                with anyio.CancelScope(shield=True):
                    await self.cancel_if_abandoned()

    async def _events(self, wake: Wake) -> AsyncGenerator[tuple[int, Event | None], None]:
        """(choice, event) of every choice's job as they come, until each has its final event or `wake` is closed;
        None is a keepalive tick. One choice: its follower alone (no task: the 2,000-stream path)."""
        if len(self.job_ids) == 1:
            async with aclosing(self.gw.hub.follow(self.job_id, wake=wake)) as events:
                async for event in events:
                    yield 0, event
            return
        wakes = [Wake() for _ in self.job_ids]
        wake.linked = tuple(wakes)  # the client leaving closes every choice's follower
        queue: asyncio.Queue[tuple[int, Event | None] | BaseException | None] = asyncio.Queue()

        async def pump(choice: int) -> None:
            try:
                async with aclosing(self.gw.hub.follow(self.job_ids[choice], wake=wakes[choice])) as events:
                    async for event in events:
                        queue.put_nowait((choice, event))
            except Exception as exc:  # the merged stream raises it
                queue.put_nowait(exc)
            finally:
                queue.put_nowait(None)  # this choice's events ended

        pumps = [asyncio.create_task(pump(choice)) for choice in range(len(self.job_ids))]
        try:
            num_open = len(pumps)
            while num_open:
                item = await queue.get()
                if item is None:
                    num_open -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item
        finally:
            for task in pumps:
                task.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)

    def _chunk(
        self,
        choice: int,
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
                        index=choice,
                        delta=delta,
                        finish_reason=finish,
                        logprobs=logprobs if isinstance(logprobs, ChatLogprobs) else None,
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
                        index=choice,
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
        """The client left before its jobs finished: cancel them (once), when settings say so."""
        if not self.unfinished or not self.gw.settings.cancel_on_disconnect:
            return
        abandoned, self.unfinished = sorted(self.unfinished), set()
        await self._cancel(abandoned, "client left")

    async def _cancel(self, job_ids: list[str], why: str) -> None:
        for job_id in job_ids:
            try:
                result = await self.gw.store.cancel(job_id)
            except (RedisConnectionError, RedisTimeoutError) as exc:
                log.warning("could not cancel job %s (%s): %s", job_id, why, exc)
                continue
            log.info("%s: job %s cancelled (%s)", why, job_id, result)
