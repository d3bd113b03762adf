"""OpenAI's Responses API, the answer side: the `response` object of a job (whole, polled, or the last event of a
stream), and the record a stored response keeps in its job's hash (keys.RESPONSE_FIELD) to be read again, chained
(`previous_response_id`) and listed (`input_items`).

The answer is the chat route's (shared/openai_compat.chat_answer: a reasoning model's thinking apart, the content
read as function calls under tools), written as output items: a `reasoning` item (its text as `reasoning_text`
content), then either the `function_call` items or one assistant `message` with an `output_text` part. Item ids
derive from the job's (`msg_<job>`, `fc_<job>_<i>`, `rs_<job>`), so a stream's items and the stored response
name the same items. A job still queued or running has no output yet; one cut by `max_output_tokens` is
`incomplete`; a failed, cancelled or expired job's response is `failed` or `cancelled` with its error.
"""

import logging
from typing import Any, Literal

from pydantic import BaseModel, Field

from shared import openai_compat as oa
from shared.job_state import ErrorCode, JobStatus
from shared.openai_logprobs import chat_logprobs
from shared.openai_response_items import FunctionCallItem, InputItem, MessageItem, ReasoningItem, TextContent
from shared.openai_responses import GUIDED_FIELDS, ResponseRequest, response_id
from shared.reasoning import ReasoningParser
from shared.schemas import Job

log = logging.getLogger(__name__)

Status = Literal["queued", "in_progress", "completed", "incomplete", "failed", "cancelled"]
ItemStatus = Literal["in_progress", "completed", "incomplete"]
_STATUS = {
    JobStatus.QUEUED: "queued",
    JobStatus.RUNNING: "in_progress",
    JobStatus.FAILED: "failed",
    JobStatus.EXPIRED: "failed",
    JobStatus.CANCELLED: "cancelled",
}


def message_id(job_id: str) -> str:
    return f"msg_{job_id}"


def function_call_item_id(job_id: str, index: int) -> str:
    return f"fc_{job_id}_{index}"


def reasoning_id(job_id: str) -> str:
    return f"rs_{job_id}"


def input_item_id(job_id: str, index: int) -> str:
    """The id an input item the client sent without one takes (input_items lists every item with an id)."""
    return f"in_{job_id}_{index}"


def kept_request(body: ResponseRequest) -> dict[str, Any]:
    """What a response keeps of its request to write its answer later: every field given but `input`, as JSON."""
    return body.model_dump(mode="json", exclude={"input", *GUIDED_FIELDS}, exclude_unset=True, by_alias=True)


def request_of(kept: dict[str, Any]) -> ResponseRequest:
    """A kept request (kept_request) as it was validated; one that no longer validates (a setting or a schema that
    changed since) keeps what reads the output: the request with no options."""
    try:
        return ResponseRequest.model_validate({**kept, "input": "."})
    except ValueError as exc:
        log.warning("a kept Responses request no longer validates (%s); read without its options", exc)
        return ResponseRequest.model_validate({"input": "."})


class ResponseRecord(BaseModel):
    """What a stored response keeps beside its job: the request (as validated), the conversation before it (a
    previous response's items and output, as input items) and its own input items, each with an id."""

    request: dict[str, Any]  # ResponseRequest's fields but `input`, as JSON
    history: list[dict[str, Any]] = Field(default_factory=list)  # input items
    input: list[dict[str, Any]]  # input items, ids set

    @classmethod
    def of(cls, job_id: str, body: ResponseRequest, history: list[InputItem]) -> "ResponseRecord":
        items = []
        for i, item in enumerate(body.input_items()):
            dumped = item.model_dump(mode="json", exclude_none=True, by_alias=True)
            if isinstance(item, MessageItem) and isinstance(item.content, str):  # listed as parts, as OpenAI's
                kind = "output_text" if item.role == "assistant" else "input_text"
                dumped["content"] = [{"type": kind, "text": item.content}]
            items.append({**dumped, "id": dumped.get("id") or input_item_id(job_id, i)})
        return cls(
            request=kept_request(body),
            history=[item.model_dump(mode="json", exclude_none=True, by_alias=True) for item in history],
            input=items,
        )

    def body(self) -> ResponseRequest:
        return request_of(self.request)


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[dict[str, Any]] | None = None


class OutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str
    status: ItemStatus
    role: Literal["assistant"] = "assistant"
    content: list[OutputText]


class OutputFunctionCall(BaseModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str
    status: ItemStatus


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class OutputReasoning(BaseModel):
    type: Literal["reasoning"] = "reasoning"
    id: str
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText]
    status: ItemStatus


OutputItem = OutputMessage | OutputFunctionCall | OutputReasoning


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0  # the prompt tokens the worker's prefix cache held (workers/engine/prefix_cache.py)


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0  # not counted apart: a thought's tokens are in output_tokens


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class ResponseError(BaseModel):
    code: str
    message: str


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class Response(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: float
    completed_at: float | None = None
    status: Status
    model: str
    output: list[OutputItem]
    usage: ResponseUsage | None = None
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    previous_response_id: str | None = None
    metadata: dict[str, str] = Field(default_factory=dict)
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] = Field(default_factory=list)
    tool_choice: str | dict[str, Any] = "auto"
    parallel_tool_calls: bool = True
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    truncation: Literal["disabled"] = "disabled"
    background: bool = False
    store: bool = True
    user: str | None = None
    reasoning: dict[str, Any] = Field(default_factory=lambda: {"effort": None, "summary": None})


def output_items(job: Job, body: ResponseRequest, reasoning_parser: ReasoningParser) -> tuple[list[OutputItem], bool]:
    """A finished job's output items, and whether the answer was cut (`max_output_tokens`)."""
    text = job.output.text if job.output else ""
    reason = oa.finish_reason(job.output.finish_reason if job.output else None)
    message, reason = oa.chat_answer(job.id, text, reason, body.chat.call_reading(), reasoning_parser)
    is_cut = reason == "length"
    status: ItemStatus = "incomplete" if is_cut else "completed"
    items: list[OutputItem] = []
    if message.reasoning_content:  # cut while thinking: incomplete; else the thought ended before the answer
        thought_status: ItemStatus = "incomplete" if is_cut and not message.content and not message.tool_calls else "completed"
        thought = [ReasoningText(text=message.reasoning_content)]
        items.append(OutputReasoning(id=reasoning_id(job.id), content=thought, status=thought_status))
    for i, call in enumerate(message.tool_calls or []):
        items.append(OutputFunctionCall(id=function_call_item_id(job.id, i), call_id=call.id, name=call.function.name,
                                        arguments=call.function.arguments, status=status))  # fmt: skip
    if message.tool_calls is None:
        logprobs = None
        if body.wants_logprobs and job.output is not None and job.output.logprobs is not None:
            logprobs = [t.model_dump(mode="json") for t in chat_logprobs(job.output.logprobs).content or []]
        part = OutputText(text=message.content or "", logprobs=logprobs)
        items.append(OutputMessage(id=message_id(job.id), status=status, content=[part]))
    return items, is_cut


def response_of(job: Job, body: ResponseRequest, model: str, reasoning_parser: ReasoningParser) -> Response:
    """The `response` object of a job, in whatever state it is."""
    response = Response(
        id=response_id(job.id),
        created_at=job.created_at,
        status="completed",
        model=model,
        output=[],
        instructions=body.instructions,
        max_output_tokens=body.max_output_tokens,
        previous_response_id=body.previous_response_id,
        metadata=body.metadata or {},
        temperature=body.temperature if body.temperature is not None else 1.0,
        top_p=body.top_p if body.top_p is not None else 1.0,
        tools=[tool.model_dump(mode="json", exclude_none=True) for tool in body.tools or []],
        tool_choice=body.tool_choice.model_dump() if isinstance(body.tool_choice, BaseModel) else body.tool_choice or "auto",
        parallel_tool_calls=body.parallel_tool_calls is not False,
        background=bool(body.background),
        store=body.is_stored,
        user=body.user,
    )
    if body.text is not None and body.text.format is not None:
        response.text = {"format": body.text.format.model_dump(mode="json", exclude_none=True, by_alias=True)}
    if job.status is JobStatus.SUCCEEDED:
        response.output, is_cut = output_items(job, body, reasoning_parser)
        response.status = "incomplete" if is_cut else "completed"
        response.incomplete_details = IncompleteDetails(reason="max_output_tokens") if is_cut else None
    else:
        response.status = _STATUS[job.status]  # type: ignore[assignment]
        if job.status.is_terminal:
            info = job.error
            code = "invalid_prompt" if info is not None and info.code in (ErrorCode.PROMPT_TOO_LONG, ErrorCode.INVALID_REQUEST) else "server_error"
            response.error = ResponseError(code=code, message=info.message if info else f"the job {job.status.value}")
    if job.status.is_terminal:
        response.completed_at = job.completed_at
        prompt_tokens = job.usage.prompt_tokens or 0
        response.usage = ResponseUsage(
            input_tokens=prompt_tokens, output_tokens=job.usage.completion_tokens,
            total_tokens=prompt_tokens + job.usage.completion_tokens,
            input_tokens_details=InputTokensDetails(cached_tokens=job.usage.cached_tokens or 0),
        )  # fmt: skip
    return response


def output_as_input(response: Response) -> list[InputItem]:
    """A response's output as the next turn's input items (`previous_response_id`)."""
    items: list[InputItem] = []
    for item in response.output:
        if isinstance(item, OutputMessage):
            parts = [TextContent(type="output_text", text=p.text) for p in item.content]
            items.append(MessageItem(role="assistant", content=parts, id=item.id))
        elif isinstance(item, OutputFunctionCall):
            items.append(FunctionCallItem(type="function_call", call_id=item.call_id, name=item.name, arguments=item.arguments, id=item.id))
        else:
            items.append(ReasoningItem(type="reasoning", id=item.id))
    return items
