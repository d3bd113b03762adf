"""OpenAI's Responses API on the gateway: a response is a chat call (gateway/openai_api.py Call: its submit,
its wait, its cancel when the client leaves) whose answer is written as a `response` object
(shared/openai_response_object.py) or as Responses events (gateway/openai_responses_stream.py).

A stored response (`store`, the default) keeps its record in its job's hash (keys.RESPONSE_FIELD): GET, cancel,
delete, `input_items` and `previous_response_id` read it there, for as long as the job's record lives
(result_ttl_s after it ends). Only the key that created a response sees it (another key: 404). `background: true`
answers at once with the queued response and leaves the job running whatever the client does.
"""

import logging
from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Any

import anyio
from fastapi import Request, Response
from fastapi.responses import JSONResponse

from gateway.auth import Caller, may_access
from gateway.deps import Gateway
from gateway.errors import ApiError
from gateway.openai_api import JOB_ID_HEADER, Call, ChunkStream, _job_failure
from gateway.openai_responses_stream import ResponseEvents
from gateway.openai_stream_chat import ChoiceText
from gateway.openai_stream_logprobs import StreamLogprobs
from gateway.streaming import Wake
from shared import keys
from shared import openai_compat as oa
from shared import openai_response_object as ro
from shared.api_keys import ApiKey
from shared.job_record import job_from_fields
from shared.job_state import ErrorCode, JobStatus
from shared.openai_response_items import InputItem, items_of
from shared.openai_responses import ResponseRequest, job_id_of
from shared.schemas import DoneEvent, EventType, Job, TokenEvent

log = logging.getLogger(__name__)


class StoredResponse:
    """A stored response read back: its job, its record and the request it was made with."""

    def __init__(self, job: Job, record: ro.ResponseRecord) -> None:
        self.job = job
        self.record = record
        self.body = record.body()


async def load(gw: Gateway, request: Request, key: ApiKey, resp_id: str, param: str = "response_id") -> StoredResponse:
    """The caller's stored response `resp_id`; 404 if there is none (never stored, deleted, expired, or
    another key's)."""
    fields = await gw.store.get(job_id_of(resp_id))
    if fields is None or keys.RESPONSE_FIELD not in fields or not may_access(key, fields.get(keys.OWNER_FIELD)):
        raise ApiError(404, ErrorCode.NOT_FOUND, f"no response {resp_id}", field=param)
    record = ro.ResponseRecord.model_validate_json(fields[keys.RESPONSE_FIELD])
    return StoredResponse(job_from_fields(fields, gw.base_url(request)), record)


async def history_of(gw: Gateway, request: Request, key: ApiKey, body: ResponseRequest) -> list[InputItem]:
    """The conversation before this response: the previous response's history, input and output (400 while that
    response has not completed)."""
    if body.previous_response_id is None:
        return []
    previous = await load(gw, request, key, body.previous_response_id, param="previous_response_id")
    answer = ro.response_of(previous.job, previous.body, "", gw.settings.reasoning_parser)
    if answer.status not in ("completed", "incomplete"):
        raise ApiError(400, ErrorCode.INVALID_REQUEST, f"previous_response_id: the response is {answer.status}; "
                       "a conversation goes on from a completed one", field="previous_response_id")  # fmt: skip
    try:
        before = items_of([*previous.record.history, *previous.record.input])
    except ValueError as exc:  # stored by another version of specfleet, or changed in Redis
        raise ApiError(400, ErrorCode.INVALID_REQUEST, f"previous_response_id: its stored conversation does not "
                       f"read any more ({exc})", field="previous_response_id") from None  # fmt: skip
    return [*before, *ro.output_as_input(answer)]


class ResponseCall(Call):
    def __init__(self, gw: Gateway, request: Request, body: ResponseRequest, history: list[InputItem]) -> None:
        try:
            chat = body.chat_request(history) if history else body.chat
        except ValueError as exc:  # the conversation with its history (the request alone was checked)
            raise ApiError(400, ErrorCode.INVALID_REQUEST, str(exc), field="previous_response_id") from None
        super().__init__(gw, request, chat, is_chat=True)
        self.response_body = body
        self.history = history
        self.starting_after = -1  # a replay's (GET ...?stream=true&starting_after=N): the events it leaves out

    async def respond(self, caller: Caller, idempotency_key: str | None) -> Response:
        self.model = await self.gw.served_model.check(self.response_body.model)
        try:
            headers = await self._submit(caller, self._job_requests(), idempotency_key)
        except ApiError as exc:  # the job's limits name its max_tokens: here the request's max_output_tokens
            if exc.info.field == "max_tokens":
                exc.info.field, exc.info.message = "max_output_tokens", exc.info.message.replace("max_tokens", "max_output_tokens")
            raise
        if self.response_body.is_stored:
            record = ro.ResponseRecord.of(self.job_id, self.response_body, self.history)
            try:
                await self.gw.store.keep_response(self.job_id, record.model_dump_json())
            except BaseException:  # a response nobody could find: its job must not run on unanswered
                with anyio.CancelScope(shield=True):
                    await self._cancel(self.job_ids, "its response could not be stored")
                raise
        if self.response_body.background:
            self.unfinished = set()  # the job is the client's to cancel, not its connection's
        if self.response_body.stream:
            return ChunkStream(self, headers)
        if self.response_body.background:
            return JSONResponse(self.answer(await self._job()).model_dump(mode="json"), headers=headers)
        job = (await self._wait())[0]
        if job.status is not JobStatus.SUCCEEDED:
            error = _job_failure(job)
            error.headers = {**(error.headers or {}), JOB_ID_HEADER: headers[JOB_ID_HEADER]}
            raise error
        return JSONResponse(self.answer(job).model_dump(mode="json"), headers=headers)

    def answer(self, job: Job) -> ro.Response:
        return ro.response_of(job, self.response_body, self.model, self.gw.settings.reasoning_parser)

    async def _job(self) -> Job:
        return (await self.jobs())[0]

    @classmethod
    def replay(cls, gw: Gateway, request: Request, stored: StoredResponse, model: str, starting_after: int) -> "ResponseCall":
        """A stored response's events again, from its job's first (`GET ...?stream=true`), those after
        `starting_after`; the job is not this connection's to cancel."""
        call = cls(gw, request, stored.body, [])
        call.job_ids, call.model, call.starting_after = [stored.job.id], model, starting_after
        return call

    async def frames(self, wake: Wake) -> AsyncGenerator[bytes, None]:
        async with aclosing(self._frames(wake)) as frames:
            async for frame in frames:
                if frame:  # b"": an event up to `starting_after`
                    yield frame

    async def _frames(self, wake: Wake) -> AsyncGenerator[bytes, None]:
        """The response's events as the job's tokens come; the last one the response as GET reads it."""
        events = ResponseEvents(self.job_id, self.starting_after)
        scores = StreamLogprobs(self.body) if self.response_body.wants_logprobs else None
        pending: list[dict[str, Any]] = []  # logprobs of tokens whose text has not gone out as the answer's yet

        def with_logprobs(delta: oa.ChatDelta) -> list[bytes]:
            """A delta's events, the answer's text carrying every logprob since the last (a thought's, a held
            piece's: the deltas' logprobs add up to the message's, one a token)."""
            nonlocal pending
            scored, pending = (pending, []) if delta.content and pending else (None, pending)
            return events.on_delta(delta, scored)

        text = ChoiceText(self.gw.settings.reasoning_parser, self.body.call_reading(), self.job_id)  # type: ignore[union-attr]
        job = await self._job()  # opened in progress, as OpenAI's streams open (a replay of an ended one too)
        for frame in events.opening(self.answer(job.model_copy(update={"status": JobStatus.RUNNING, "output": None}))):
            yield frame
        try:
            async with aclosing(self._events(wake)) as stream:
                async for _, event in stream:
                    if event is None:
                        yield b": keepalive\n\n"
                    elif event.type is EventType.TOKEN:
                        token = TokenEvent.model_validate_json(event.data)
                        if scores is not None and (got := scores.of(token)) is not None:
                            pending += [t.model_dump(mode="json") for t in getattr(got, "content", None) or []]
                        for delta in text.on_text(token.text) if token.text else []:
                            for frame in with_logprobs(delta):
                                yield frame
                    elif event.type.is_final:
                        self.unfinished.discard(self.job_id)
                        if event.type is EventType.DONE:
                            reason = oa.finish_reason(DoneEvent.model_validate_json(event.data).finish_reason)
                            for delta in text.on_done(reason)[0]:  # what the splitter and the call reading held
                                for frame in with_logprobs(delta):
                                    yield frame
                            if pending:  # tokens whose text never went out as the answer's (the last, or a thought)
                                for frame in events.on_delta(oa.ChatDelta(), pending):
                                    yield frame
                                pending = []
                        for frame in events.closing(self.answer(await self._job())):
                            yield frame
                        break
        finally:
            if self.unfinished:
                with anyio.CancelScope(shield=True):
                    await self.cancel_if_abandoned()
