"""OpenAI's Responses API (`POST /v1/responses`), the request side: what a client may send, and the chat request
it becomes (shared/openai_compat.py's ChatCompletionRequest, so every check, default and translation to a job is
the chat route's own).

`input` is a string (one user message) or a list of items: messages (`role` user/system/developer/assistant,
`content` a string or `input_text`/`output_text` parts), `function_call` items (a call the model made) and
`function_call_output` items (its result); `reasoning` items a client sends back are dropped (the models' chat
templates take no thoughts). `instructions` is a system message before them, for this response only (a
`previous_response_id` carries the earlier conversation, not its instructions, as OpenAI's). `tools` are
function tools in the Responses shape (`{"type": "function", "name", "parameters"}`), `text.format` is the
answer's format (`text`, `json_object`, `json_schema` with its name and schema at the top), `max_output_tokens`
bounds the answer, `include: ["message.output_text.logprobs"]` + `top_logprobs` ask for logprobs. `store`
(default true) keeps the response for GET, chaining and `input_items`; `background: true` answers at once, queued.
A batch line's body is the same request, with what a line cannot be refused (batch_line_request).
specfleet's and vLLM's extra fields (priority, top_k, structured_outputs, ...) are the chat route's.

What would change the answer and is not done here is refused with its reason: tools other than functions,
`reasoning.effort`, `truncation: auto`, images and files, a stored `prompt` or `conversation`.
"""

from typing import Any, Literal

from pydantic import (
    ConfigDict,
    Field,
    PrivateAttr,
    StrictBool,
    StrictInt,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from shared.openai_compat import GUIDED, ChatCompletionRequest, ChatMessage, _Common
from shared.openai_response_items import InputItem, MessageItem, Strict, chat_messages, item_of
from shared.response_format import FUNCTION_NAME_PATTERN

RESPONSE_ID_PREFIX = "resp_"
RESPONSE_ID_PATTERN = r"^resp_[A-Za-z0-9_-]{1,64}$"
MAX_INPUT_ITEMS = 1024
LOGPROBS_INCLUDE = "message.output_text.logprobs"  # the one `include` that adds something here
MAX_METADATA_PAIRS = 16  # as OpenAI
GUIDED_FIELDS = {"guided_" + name for name in GUIDED}  # vLLM's older spellings: structured_outputs once validated


def response_id(job_id: str) -> str:
    """A response's id: its job's, so GET /v1/jobs/{id} shows the job behind it."""
    return f"{RESPONSE_ID_PREFIX}{job_id}"


def job_id_of(resp_id: str) -> str:
    return resp_id.removeprefix(RESPONSE_ID_PREFIX)


# -- tools and formats ---------------------------------------------------------------------------------------------
class FunctionTool(Strict):
    type: Literal["function"]
    name: str = Field(pattern=FUNCTION_NAME_PATTERN)
    description: str | None = Field(None, max_length=4096)
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None

    def chat_tool(self) -> dict[str, Any]:
        function = self.model_dump(exclude={"type"}, exclude_none=True)
        return {"type": "function", "function": function}


class NamedFunctionChoice(Strict):
    type: Literal["function"]
    name: str


ResponseToolChoice = Literal["none", "auto", "required"] | NamedFunctionChoice


class TextFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(None, pattern=FUNCTION_NAME_PATTERN)
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = Field(None, max_length=4096)
    strict: StrictBool | None = None

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    def response_format(self) -> dict[str, Any]:
        """The chat route's `response_format` of this format."""
        if self.type != "json_schema":
            return {"type": self.type}
        if self.name is None or self.schema_ is None:
            raise ValueError("text.format of type json_schema needs `name` and `schema`")
        schema = {"name": self.name, "schema": self.schema_, "description": self.description, "strict": self.strict}
        return {"type": "json_schema", "json_schema": {k: v for k, v in schema.items() if v is not None}}


class TextConfig(Strict):
    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = None  # the served models have no verbosity setting: medium, or unset


class ReasoningConfig(Strict):
    effort: None = None  # the served models have no reasoning modes
    summary: None = None
    generate_summary: None = None


RESPONSES_URL = "/v1/responses"

# -- the request ---------------------------------------------------------------------------------------------------
class ResponseRequest(_Common):
    """`POST /v1/responses`' body. The fields it shares with chat (model, temperature, top_p, stream, metadata,
    user, store, service_tier and the extras) are _Common's."""

    input: str | list[InputItem]
    instructions: str | None = None  # a system message: the prompt limits count it with the rest
    max_output_tokens: StrictInt | None = Field(None, ge=1, le=1_000_000)
    previous_response_id: str | None = Field(None, pattern=RESPONSE_ID_PATTERN)
    background: StrictBool | None = None
    tools: list[FunctionTool] | None = Field(None, max_length=128)
    tool_choice: ResponseToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None
    max_tool_calls: StrictInt | None = Field(None, ge=1)  # a bound on calls: an answer makes one at most
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    include: list[str] | None = Field(None, max_length=16)
    top_logprobs: StrictInt | None = Field(None, ge=0, le=20)
    truncation: Literal["disabled"] | None = None  # `auto` would drop turns of the conversation: refused
    prompt_cache_key: str | None = Field(None, max_length=1024)
    safety_identifier: str | None = Field(None, max_length=256)
    prompt: None = None  # a stored prompt template: none here
    conversation: None = None  # OpenAI's conversation objects: none here (previous_response_id chains)

    _chat: ChatCompletionRequest | None = PrivateAttr(None)

    @field_validator("input", mode="before")
    @classmethod
    def _items(cls, value: Any) -> Any:
        if isinstance(value, list):
            if not value:
                raise ValueError("input: at least one item")
            if len(value) > MAX_INPUT_ITEMS:
                raise ValueError(f"input: at most {MAX_INPUT_ITEMS} items")
            return [item_of(i, raw) for i, raw in enumerate(value)]
        return value

    @field_validator("n", "max_tokens", "stop", "logit_bias", mode="before")
    @classmethod
    def _not_here(cls, value: Any, info: ValidationInfo) -> Any:
        if value is not None:
            other = {"max_tokens": "use max_output_tokens", "n": "a response has one output (n is a chat field)"}
            raise ValueError(f"not a Responses field: {other.get(str(info.field_name), 'use /v1/chat/completions')}")
        return value

    @field_validator("include")
    @classmethod
    def _includes(cls, value: list[str] | None) -> list[str] | None:
        for name in value or []:
            if name != LOGPROBS_INCLUDE:
                raise ValueError(f"`{name}` cannot be included here (only `{LOGPROBS_INCLUDE}`)")
        return value

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        if value is not None and (len(value) > MAX_METADATA_PAIRS or any(len(k) > 64 or len(v) > 512 for k, v in value.items())):
            raise ValueError(f"metadata: at most {MAX_METADATA_PAIRS} pairs, keys up to 64 and values up to 512 characters")
        return value

    @model_validator(mode="after")
    def _shape(self) -> "ResponseRequest":
        if self.background and self.store is False:
            raise ValueError("background: a background response is stored (store must not be false)")
        if self.top_logprobs and not self.wants_logprobs:
            raise ValueError(f"top_logprobs needs include: [\"{LOGPROBS_INCLUDE}\"]")
        if self.wants_logprobs and self.stream and self.tools and self.tool_choice != "none":
            raise ValueError(f"include `{LOGPROBS_INCLUDE}`: not supported on a stream with tools (use stream: false)")
        self._chat = self.chat_request([])  # the chat route's checks (tools, formats, extras), named as they fail
        return self

    def requested_max_tokens(self) -> int | None:
        return self.max_output_tokens

    @property
    def chat(self) -> ChatCompletionRequest:
        """The chat request of this response alone (chat_request without history), as validated."""
        assert self._chat is not None  # set by _shape
        return self._chat

    @property
    def wants_logprobs(self) -> bool:
        return LOGPROBS_INCLUDE in (self.include or [])

    @property
    def is_stored(self) -> bool:
        return self.store is not False

    def input_items(self) -> list[InputItem]:
        return [MessageItem.model_validate({"role": "user", "content": self.input})] if isinstance(self.input, str) else list(self.input)

    def chat_request(self, history: list[InputItem]) -> ChatCompletionRequest:
        """The chat request this response is: `instructions`, then the conversation before it (`history`: a
        previous response's items and output), then its input. ValueError naming what the chat route refused."""
        messages = [ChatMessage.model_validate({"role": "system", "content": self.instructions})] if self.instructions else []
        messages += chat_messages([*history, *self.input_items()])
        if not messages:
            raise ValueError("input: the conversation has no message (only thoughts)")
        shared = self.model_dump(
            include=set(_Common.model_fields) - GUIDED_FIELDS,
            exclude_unset=True,
        )
        if self.structured_outputs is not None:  # set by _Common from a guided_* field, or given
            shared["structured_outputs"] = self.structured_outputs.model_dump(exclude_none=True)
        body: dict[str, Any] = {**shared, "messages": [m.model_dump(exclude_none=True) for m in messages]}
        if self.max_output_tokens is not None:
            body["max_completion_tokens"] = self.max_output_tokens
        if self.tools:
            body["tools"] = [tool.chat_tool() for tool in self.tools]
        if self.tool_choice is not None:
            choice = self.tool_choice
            body["tool_choice"] = choice if isinstance(choice, str) else {"type": "function", "function": {"name": choice.name}}
        if self.text is not None and self.text.format is not None:
            body["response_format"] = self.text.format.response_format()
        if self.wants_logprobs:
            body["logprobs"] = True
            body["top_logprobs"] = self.top_logprobs or 0
        try:
            return ChatCompletionRequest.model_validate(body)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(part) for part in first["loc"])
            raise ValueError(f"{where}: {first['msg'].removeprefix('Value error, ')}" if where else first["msg"]) from None


def batch_line_request(body: dict[str, Any]) -> "ResponseRequest":
    """A batch line's Responses body, validated: a line is a whole conversation answered in its batch (no stream,
    no background, no previous response) and its response is in the batch's output, not stored for GET."""
    request = ResponseRequest.model_validate(body)
    for name, why in (("stream", "a batch line cannot stream (stream must be false)"),
                      ("background", "a batch line runs in its batch (leave background out)"),
                      ("previous_response_id", "a batch line is a conversation of its own: send its whole input")):  # fmt: skip
        if getattr(request, name):
            raise ValueError(f"{name}: {why}")
    return request.model_copy(update={"store": False, "priority": None})
