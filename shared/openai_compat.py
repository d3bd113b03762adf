"""OpenAI `/v1/completions` and `/v1/chat/completions` <-> our jobs, in one place: the HTTP endpoints
(gateway/routes/openai_*.py) and batch lines (shared/batch_format.py) both translate through it.

Request: `prompt` (a string or its token ids: the job's `prompt` or `prompt_token_ids`; or several, a job each;
`echo` of token ids needs logprobs) or `messages` (system/developer/user/assistant, string
content or text parts), with `max_tokens` (chat: also `max_completion_tokens`), `temperature`, `top_p`, `stop`
(string or list), `seed`, `n` (a job a choice: choice_requests; batch lines take 1), `stream` +
`stream_options.include_usage` (HTTP only), `logprobs` (completions: N up to 5, with `echo` the prompt's too;
chat: `logprobs` + `top_logprobs`; shared/openai_logprobs.py), `logit_bias` (token id -> a bias in [-100, 100]
added to its logit wherever the target samples: workers/engine/logit_bias.py), `presence_penalty` and
`frequency_penalty` (workers/engine/penalties.py), and specfleet's own `priority`, `top_k`, `min_p`, `ignore_eos`,
`repetition_penalty`, `min_tokens`, `stop_token_ids`, `include_stop_str_in_output`, `skip_special_tokens`,
`allowed_token_ids`, `cache_salt`, `structured_outputs` (and its
older `guided_*` spellings) (as vLLM's extra parameters), `speculative` (the job API's), `timeout_s` (the execution deadline) and
`stream_interval_ms` (stream chunks at most this often, each with the tokens since the last). Fields of OpenAI's schema that change nothing here (`user`, `metadata`, `store`,
`logprobs` off, ...) are accepted and ignored; asking them for something we do not do
(`best_of` > 1, `reasoning_effort`, ...) is a clear error naming the field, and a field OpenAI does not know is
refused (it would silently change nothing). Types are strict (no `0` for false, no `"2"` for 2): a client
sending the wrong type has a bug worth hearing about. Chat messages go to the job as `messages`: the worker renders them
with the tokenizer's chat template, or without one as `"{role}: {content}\\n"` per message, then `"assistant:"`
(workers/worker/prompts.py). Defaults follow OpenAI: `max_tokens` 16 for completions, 256 (ours) for chat;
temperature 1, top_p 1.

Response: the `text_completion` / `chat.completion` object of a finished job, and the chunks of a stream.
"""

import json
from collections.abc import Sequence
from pathlib import PurePath
from typing import Annotated, Any, ClassVar, Literal, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    JsonValue,
    SerializerFunctionWrapHandler,
    StrictBool,
    StrictFloat,
    StrictInt,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_serializer,
    model_validator,
)

from shared import chat_template
from shared.logprobs import TokenLogprob
from shared.openai_logprobs import (
    MAX_CHAT_TOP_LOGPROBS,
    MAX_COMPLETION_LOGPROBS,
    ChatLogprobs,
    CompletionLogprobs,
    chat_logprobs,
    completion_logprobs,
)
from shared.reasoning import ReasoningParser, split_reasoning
from shared.response_format import (
    CallReading,
    ResponseFormat,
    StructuredOutputs,
    Tool,
    ToolCall,
    ToolCallDelta,
    ToolChoice,
    ToolSet,
    tool_call_objects,
    tool_calls_of,
)
from shared.schemas import (
    MAX_ALLOWED_TOKEN_IDS,
    MAX_LOGIT_BIAS_TOKENS,
    MAX_REPETITION_PENALTY,
    MAX_SEED,
    MAX_STREAM_INTERVAL_MS,
    MAX_TIMEOUT_S,
    MAX_TOKEN_ID,
    MAX_TOP_K,
    MIN_SEED,
    Job,
    JobRequest,
    LogitBias,
    Message,
    Priority,
    Usage,
    speculation_choice,
)
from shared.speculation import SpeculativeMethod

COMPLETIONS_URL = "/v1/completions"
CHAT_COMPLETIONS_URL = "/v1/chat/completions"
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_STOP_SEQUENCES = 4  # as OpenAI


def _valid_text(value: str) -> str:
    """Refuse lone surrogates (JSON `\\ud800`): they cannot be encoded, tokenized or stored."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError("the text is not valid Unicode (a lone surrogate)") from exc
    return value


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: StrictBool | None = None
    include_obfuscation: StrictBool | None = None  # OpenAI's padding of chunks against length side channels: none here


GUIDED = ("json", "regex", "choice", "grammar")  # vLLM's guided_<x>: structured_outputs' <x>
MAX_CHOICES = 16  # `n`: each choice is a job of its own (choice_requests)
StrictTokenId = Annotated[StrictInt, Field(ge=0, le=MAX_TOKEN_ID)]  # a token id as the job takes it (no "7" for 7)
MAX_JOBS_PER_CALL = 64  # prompts x n of one completions call


class _Common(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)  # NaN, Infinity: "should be a finite number"

    model: str | None = Field(None, max_length=256)
    max_tokens: StrictInt | None = Field(None, ge=1, le=1_000_000)
    temperature: StrictFloat | None = Field(None, ge=0.0, le=2.0)
    top_p: StrictFloat | None = Field(None, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: StrictInt | None = Field(None, ge=MIN_SEED, le=MAX_SEED)
    n: StrictInt | None = None
    stream: StrictBool | None = None
    stream_options: StreamOptions | None = None
    # specfleet's extensions (as vLLM's): the queue of the job behind the call, top-k, generating past EOS
    priority: Priority | None = None
    top_k: StrictInt | None = Field(None, ge=-1, le=MAX_TOP_K)
    min_p: StrictFloat | None = Field(None, ge=0.0, le=1.0)  # vLLM's (0: off)
    ignore_eos: StrictBool | None = None
    timeout_s: StrictFloat | StrictInt | None = Field(None, gt=0, le=MAX_TIMEOUT_S)  # deadline (or Cancel-After)
    stream_interval_ms: StrictInt | None = Field(None, ge=0, le=MAX_STREAM_INTERVAL_MS)  # chunks at most this often
    repetition_penalty: StrictFloat | None = Field(None, gt=0.0, le=MAX_REPETITION_PENALTY)  # vLLM's (1: off)
    min_tokens: StrictInt | None = Field(None, ge=0, le=1_000_000)  # vLLM's: no EOS nor any stop before
    speculative: bool | SpeculativeMethod | None = None  # the job API's: true (the worker's default), false, a method
    stop_token_ids: list[StrictTokenId] | None = Field(None, max_length=64)  # vLLM's: these tokens end it too
    include_stop_str_in_output: StrictBool | None = None  # vLLM's: the answer ends with the stop string it met
    skip_special_tokens: StrictBool | None = None  # vLLM's: false leaves special tokens' text in the answer
    # OpenAI's sampling controls on the target's logits (workers/engine/logit_bias.py, penalties.py)
    presence_penalty: StrictFloat | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: StrictFloat | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: LogitBias | None = Field(None, max_length=MAX_LOGIT_BIAS_TOKENS)  # token id -> [-100, 100]
    allowed_token_ids: list[StrictTokenId] | None = Field(None, min_length=1, max_length=MAX_ALLOWED_TOKEN_IDS)  # vLLM's
    cache_salt: str | None = Field(None, min_length=1, max_length=256)  # vLLM's: the prefix cache's sharing key
    # vLLM's structured output: a regex, a choice, a Lark grammar or a JSON schema (shared/response_format.py);
    # its older spellings, one field each, mean the same
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # OpenAI's fields that change nothing here: accepted and ignored (refused where they would change output)
    user: str | None = Field(None, max_length=256)
    metadata: dict[str, str] | None = None
    store: StrictBool | None = None
    service_tier: str | None = Field(None, max_length=64)

    @field_validator("n")
    @classmethod
    def _choices(cls, value: StrictInt | None) -> int | None:
        if value is not None and not 1 <= value <= MAX_CHOICES:
            raise ValueError(f"n is 1 to {MAX_CHOICES} choices (each one a job)")
        return value

    @property
    def num_choices(self) -> int:
        return self.n or 1

    @field_validator("stop")
    @classmethod
    def _stops(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else (value or [])
        if len(stops) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences")
        if any(not s for s in stops):
            raise ValueError("stop sequences must not be empty")
        for s in stops:
            _valid_text(s)
        return value

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> "_Common":
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream: true")
        return self

    @field_validator("speculative", mode="before")
    @classmethod
    def _speculation(cls, value: Any) -> Any:
        return value if value is None else speculation_choice(value)

    @model_validator(mode="after")
    def _min_within_max(self) -> "_Common":
        """min_tokens past the answer's max_tokens (given, or the endpoint's default) could never hold."""
        most = self.requested_max_tokens() or (
            COMPLETIONS_DEFAULT_MAX_TOKENS if isinstance(self, CompletionRequest) else JobRequest.model_fields["max_tokens"].default
        )
        if self.min_tokens and self.min_tokens > most:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({most})")
        return self

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @model_validator(mode="after")
    def _one_structure(self) -> "_Common":
        """vLLM's older `guided_*` fields become `structured_outputs` (one of them, and not both spellings); it
        does not combine with a `response_format` that constrains the answer."""
        guided = {name: getattr(self, f"guided_{name}") for name in GUIDED if getattr(self, f"guided_{name}") is not None}
        if guided:
            if self.structured_outputs is not None or len(guided) > 1:
                raise ValueError(f"give one of structured_outputs, {', '.join('guided_' + n for n in GUIDED)}")
            name, value = next(iter(guided.items()))
            try:
                self.structured_outputs = StructuredOutputs.model_validate({name: value})
            except ValidationError as exc:
                raise ValueError(f"guided_{name}: {exc.errors()[0]['msg'].removeprefix('Value error, ')}") from exc
        fmt = getattr(self, "response_format", None)
        if self.structured_outputs is not None and fmt is not None and fmt.type != "text":
            raise ValueError("give one of structured_outputs or a response_format that constrains the answer")
        return self

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Common):
    # a prompt (text, or its token ids), or several (a list of texts, or of token-id lists): a job a prompt
    prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]]
    echo: StrictBool | None = None  # the answer's text (and logprobs) start with the prompt's
    logprobs: StrictInt | None = Field(None, ge=0, le=MAX_COMPLETION_LOGPROBS)  # N alternatives per token
    # accepted at their neutral values only
    best_of: StrictInt | None = None
    suffix: str | None = None
    response_format: ResponseFormat | None = None  # as vLLM's extension (structured output, shared/response_format.py)

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompts(cls, value: Any) -> Any:
        """A prompt as OpenAI takes it: a string or token ids, or a list of them (one each: a list holding one is
        that one). Its own message for each wrong shape (pydantic's would name the union's first branch,
        `prompt.str`)."""
        if isinstance(value, list) and value and all(isinstance(p, str | list) for p in value):
            if len(value) > MAX_JOBS_PER_CALL:
                raise ValueError(f"at most {MAX_JOBS_PER_CALL} prompts a call (each one a job)")
            prompts = [_one_prompt(p) for p in value]
            if len({isinstance(p, str) for p in prompts}) > 1:
                raise ValueError("several prompts are all texts or all token-id lists")
            return prompts[0] if len(prompts) == 1 else prompts
        return _one_prompt(value)

    @field_validator("best_of")
    @classmethod
    def _one_best_of(cls, value: int | None) -> int | None:
        if value not in (None, 1):
            raise ValueError("only 1 is supported")
        return value

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str | None) -> str | None:
        if value:
            raise ValueError("a suffix is not supported (only an empty one)")
        return value

    @model_validator(mode="after")
    def _neutral_extras(self) -> "CompletionRequest":
        if self.echo and self.logprobs is None and any(isinstance(prompt, list) for prompt in self.prompts()):
            raise ValueError("echo of a prompt given as token ids needs logprobs (its text is its tokens')")
        if len(self.prompts()) * self.num_choices > MAX_JOBS_PER_CALL:
            raise ValueError(f"prompts x n: at most {MAX_JOBS_PER_CALL} jobs a call")
        return self

    def prompts(self) -> list[str | list[int]]:
        """Each prompt of the call (the validator made `prompt` one prompt or a list of at least two)."""
        prompt: Any = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            return list(prompt)
        return [prompt]

    def one_per_prompt(self) -> list["CompletionRequest"]:
        """The call as one request a prompt, in order."""
        prompts = self.prompts()
        return [self] if len(prompts) == 1 else [self.model_copy(update={"prompt": p}) for p in prompts]

    def prompt_text(self) -> str | None:
        """The prompt's text; None when it came as token ids (or as several prompts: one_per_prompt)."""
        return self.prompt if isinstance(self.prompt, str) else None

    def prompt_token_ids(self) -> list[int] | None:
        prompts = self.prompts()
        return list(prompts[0]) if len(prompts) == 1 and isinstance(prompts[0], list) else None


def _one_prompt(value: Any) -> str | list[int]:
    """One prompt: text, or its token ids."""
    one = "a prompt is a string or a list of token ids (several: a list of strings, or of token-id lists)"
    if isinstance(value, str):
        if not value:
            raise ValueError("the prompt must not be empty")
        return _valid_text(value)
    if not isinstance(value, list) or not value:
        raise ValueError(one)
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise ValueError(one)
    if not all(0 <= t <= MAX_TOKEN_ID for t in value):
        raise ValueError(f"token ids are integers in [0, {MAX_TOKEN_ID}]")
    return value


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """A message as OpenAI clients send it, text parts only. A conversation's tool turns come back as an
    assistant message with `tool_calls` (content null) and one `tool` message per call with its result."""

    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = Field(None, max_length=256)
    tool_calls: list[ToolCall] | None = Field(None, max_length=128)  # assistant: the calls it made
    tool_call_id: str | None = Field(None, max_length=256)  # tool: the call this result answers

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, value: Any) -> Any:
        """A part that is not text is named (pydantic's message named the union's first branch: `content.str`)."""
        if isinstance(value, list):
            for i, part in enumerate(value):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind != "text" and isinstance(kind, str):
                    raise ValueError(f"part {i} is of type `{kind}`: only text parts are supported (the models read text)")
        return value

    @field_validator("content")
    @classmethod
    def _text(cls, value: str | list[TextPart] | None) -> str | list[TextPart] | None:
        if value is not None:
            _valid_text(value if isinstance(value, str) else "".join(p.text for p in value))
        return value

    @model_validator(mode="after")
    def _shape(self) -> "ChatMessage":
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("tool_calls: only an assistant message carries them")
        if (self.tool_call_id is not None) != (self.role == "tool"):
            raise ValueError("tool_call_id: a tool message needs one, and only a tool message has one")
        if self.content is None and not self.tool_calls:
            raise ValueError("content: required (null only in an assistant message with tool_calls)")
        return self

    def to_message(self) -> Message:
        """The engine's message: a call is written as the model answers one ({"name":...,"arguments":...}), and a
        tool's result as a user turn naming its call (the models' chat templates know three roles)."""
        text = "" if self.content is None else self.content if isinstance(self.content, str) else "".join(
            p.text for p in self.content)
        if self.role == "tool":
            return Message(role="user", content=f"Result of call {self.tool_call_id}: {text}")
        if self.tool_calls:
            calls = [{"name": c.function.name, "arguments": _arguments(c.function.arguments)} for c in self.tool_calls]
            text = "\n".join(filter(None, [text, *(json.dumps(c, separators=(",", ":")) for c in calls)]))
        return Message(role="system" if self.role == "developer" else self.role, content=text)


def _arguments(raw: str) -> Any:
    """A call's `arguments` (a JSON string, as OpenAI sends them) as JSON; text that is not JSON stays text."""
    try:
        return json.loads(raw)
    except ValueError:
        return raw


UNSUPPORTED_CHAT_FIELDS = {  # OpenAI's chat fields that would change the answer, and why none is taken
    "reasoning_effort": "the served models have no reasoning modes",
    "verbosity": "the served models have no verbosity setting (max_completion_tokens bounds the answer)",
    "audio": "only text output is supported",
    "prediction": "predicted outputs are not supported (speculative decoding needs none)",
    "web_search_options": "the models do not search the web",
    "functions": "use `tools` (functions is deprecated)",
    "function_call": "use `tool_choice` (function_call is deprecated)",
}


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1, max_length=1024)
    # vLLM's chat-template controls (shared/chat_template.py): the job's
    add_generation_prompt: StrictBool | None = None
    continue_final_message: StrictBool | None = None
    chat_template_kwargs: dict[str, JsonValue] | None = Field(None, max_length=chat_template.MAX_KWARGS)
    max_completion_tokens: StrictInt | None = Field(None, ge=1, le=1_000_000)
    logprobs: StrictBool | None = None  # each output token's logprob, with top_logprobs alternatives
    top_logprobs: StrictInt | None = Field(None, ge=0, le=MAX_CHAT_TOP_LOGPROBS)
    # accepted at their neutral values only
    parallel_tool_calls: StrictBool | None = None
    modalities: list[str] | None = Field(None, max_length=8)  # ["text"]
    # hints to OpenAI's caches and abuse checks: nothing here reads them
    prompt_cache_key: str | None = Field(None, max_length=1024)
    safety_identifier: str | None = Field(None, max_length=256)
    # OpenAI's fields that would change the answer: null only; another value is refused with its reason
    reasoning_effort: None = None
    verbosity: None = None
    audio: None = None
    prediction: None = None
    web_search_options: None = None
    functions: None = None
    function_call: None = None
    # structured output (shared/response_format.py): JSON-schema-constrained answers and function calls
    tools: list[Tool] | None = Field(None, max_length=128)
    tool_choice: ToolChoice | None = None
    response_format: ResponseFormat | None = None

    @field_validator("continue_final_message")
    @classmethod
    def _continuation(cls, value: bool | None, info: ValidationInfo) -> bool | None:
        if value and "messages" in info.data:
            add_generation_prompt = info.data.get("add_generation_prompt")
            chat_template.check_continuation(value, add_generation_prompt is not False, info.data["messages"][-1].role)
        return value

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_variables(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        return chat_template.checked_kwargs(value)

    @field_validator("modalities")
    @classmethod
    def _text_only(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and any(modality != "text" for modality in value):
            raise ValueError("only text output is supported ([\"text\"])")
        return value

    @field_validator(*UNSUPPORTED_CHAT_FIELDS, mode="before")
    @classmethod
    def _unsupported(cls, value: Any, info: ValidationInfo) -> None:
        if value is not None:
            raise ValueError(f"not supported: {UNSUPPORTED_CHAT_FIELDS[str(info.field_name)]}")

    @model_validator(mode="after")
    def _neutral_extras(self) -> "ChatCompletionRequest":
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        tools = self.tool_set()  # ValueError naming the problem (a bad name, a schema that does not compile)
        if self.tool_choice is not None and self.tool_choice != "none" and tools is None:
            raise ValueError("tool_choice needs tools")
        if tools is not None and tools.is_active:
            is_json = self.response_format is not None and self.response_format.type != "text"
            if (is_json or self.structured_outputs is not None) and tools.response_format() is not None:
                raise ValueError("response_format or structured_outputs cannot be combined with a tool_choice that forces a call")
            if self.stream and self.logprobs:  # a held answer (openai_stream_tools.py) would hold its logprobs too
                raise ValueError("logprobs: not supported on a stream with tools (use stream: false)")
        return self

    def tool_set(self) -> ToolSet | None:
        """The tools and the choice among them; None without tools."""
        if not self.tools:
            return None
        return ToolSet(tools=self.tools, tool_choice=self.tool_choice or "auto")

    def call_reading(self) -> CallReading | None:
        """How the answer reads back as function calls; None when it is text (no tools, or `none`)."""
        tools = self.tool_set()
        return tools.reading() if tools is not None else None

    def answer_format(self) -> ResponseFormat | None:
        """What constrains the answer: a forced function call, else response_format."""
        tools = self.tool_set()
        if tools is not None and tools.is_active and tools.response_format() is not None:
            return tools.response_format()
        return self.response_format

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


def to_job_request(
    req: CompletionRequest | ChatCompletionRequest, priority: Priority, default_max_tokens: int | None = None
) -> JobRequest:
    """The job of a validated OpenAI request (`priority` unless the request names one)."""
    fields: dict[str, Any] = dict(stop=req.stop_list(), seed=req.seed, priority=req.priority or priority)
    if req.temperature is not None:
        fields["temperature"] = req.temperature
    if req.top_p is not None:
        fields["top_p"] = req.top_p
    if req.top_k is not None:
        fields["top_k"] = req.top_k
    if req.ignore_eos is not None:
        fields["ignore_eos"] = req.ignore_eos
    if req.timeout_s is not None:
        fields["timeout_s"] = float(req.timeout_s)
    if req.stream_interval_ms is not None:
        fields["stream_interval_ms"] = req.stream_interval_ms
    if req.logit_bias:
        fields["logit_bias"] = req.logit_bias
    if req.structured_outputs is not None:
        fields["structured_outputs"] = req.structured_outputs
    for name in ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens", "stop_token_ids",
                 "speculative", "min_p", "include_stop_str_in_output", "allowed_token_ids", "cache_salt",
                 "skip_special_tokens"):  # fmt: skip
        if (value := getattr(req, name)) is not None:
            fields[name] = value
    if isinstance(req, CompletionRequest):
        fields["prompt"], fields["prompt_token_ids"] = req.prompt_text(), req.prompt_token_ids()
        default_max_tokens = default_max_tokens or COMPLETIONS_DEFAULT_MAX_TOKENS
        fields["logprobs"] = req.logprobs
        fields["prompt_logprobs"] = req.logprobs if req.echo else None
        fields["response_format"] = req.response_format
    else:
        fields["messages"] = [m.to_message() for m in req.messages]
        for name in ("add_generation_prompt", "continue_final_message", "chat_template_kwargs"):
            if (value := getattr(req, name)) is not None:
                fields[name] = value
        fields["logprobs"] = (req.top_logprobs or 0) if req.logprobs else None
        fields["response_format"] = req.answer_format()
        tools = req.tool_set()
        if tools is not None and tools.is_active:  # the model is told what it may call
            fields["messages"].insert(0, Message(role="system", content=tools.prompt_note()))
    max_tokens = req.requested_max_tokens() or default_max_tokens
    if max_tokens is not None:
        fields["max_tokens"] = max_tokens
    return JobRequest(**fields)


def job_request_for(
    url: str, body: dict[str, Any], priority: Priority = Priority.DEFAULT
) -> tuple[JobRequest, CallReading | None]:
    """The job for an OpenAI-style batch line body at `url` (no streaming; the batch's priority), and how its
    answer reads as function calls (a chat with active tools; else None); raises pydantic's ValidationError or
    ValueError."""
    req: CompletionRequest | ChatCompletionRequest
    if url == COMPLETIONS_URL:
        req = CompletionRequest.model_validate(body)
    elif url == CHAT_COMPLETIONS_URL:
        req = ChatCompletionRequest.model_validate(body)
    else:
        raise ValueError(f"no OpenAI translation for {url}")
    if req.stream:
        raise ValueError("a batch line cannot stream (stream must be false)")
    if isinstance(req, CompletionRequest) and req.echo:
        raise ValueError("echo is not supported in batch lines")
    if req.num_choices > 1:
        raise ValueError("body.n: one choice a line in a batch (a line is one job: send a line a choice)")
    if isinstance(req, CompletionRequest) and len(req.prompts()) > 1:
        raise ValueError("body.prompt: one prompt a line in a batch (a line is one job: send a line a prompt)")
    calls = req.call_reading() if isinstance(req, ChatCompletionRequest) else None
    return to_job_request(req.model_copy(update={"priority": None}), priority), calls


AnswerT = TypeVar("AnswerT", "Completion", "ChatCompletion")


def choice_requests(request: JobRequest, num_choices: int) -> list[JobRequest]:
    """The jobs of `n` choices: the request once a choice; with a seed, choice i samples with seed + i (wrapped
    into the seeds' range), so the choices differ and the call is reproducible."""
    if num_choices == 1:
        return [request]
    if request.seed is None:
        return [request] * num_choices
    span = MAX_SEED - MIN_SEED + 1
    return [
        request.model_copy(update={"seed": (request.seed - MIN_SEED + i) % span + MIN_SEED})
        for i in range(num_choices)
    ]


def merged(answers: list[AnswerT], num_choices: int = 1) -> AnswerT:
    """One answer of the jobs' answers (a job a choice of each prompt, in order: prompt by prompt, `num_choices`
    each): its id and time the first's, choice i the i-th answer's, and the usage as OpenAI counts it: each prompt
    once, every choice's completion tokens."""
    first = answers[0]
    if len(answers) == 1:
        return first
    choices = [answer.choices[0].model_copy(update={"index": i}) for i, answer in enumerate(answers)]
    usage = call_usage([answer.usage for answer in answers if answer.usage is not None], num_choices)
    return first.model_copy(update={"choices": choices, "usage": usage})


def served_name(published: str) -> str:
    """The model name clients see for the model a worker published (keys.MODEL_INFO `model`: a demo name or a
    model directory): the directory's name."""
    return PurePath(published).name or published


def model_of(body: dict[str, Any]) -> str | None:
    model = body.get("model")
    return model if isinstance(model, str) else None


# -- responses ------------------------------------------------------------------------------------------------
FinishReason = Literal["stop", "length", "tool_calls"]


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # the prompt tokens the worker's prefix cache held (workers/engine/prefix_cache.py)


class CompletionUsage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None  # where the prefix cache held some of the prompt


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: CompletionUsage | None = None  # on a stream: only on the usage chunk
    system_fingerprint: str | None = None


class _PlainWhenAbsent(BaseModel):
    """A message or chunk whose optional parts (OPTIONAL) are left out of its JSON when it has none: a plain text
    answer keeps OpenAI's plain shape."""

    OPTIONAL: ClassVar[tuple[str, ...]] = ("tool_calls", "reasoning_content")

    @model_serializer(mode="wrap")
    def _without_absent_parts(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data: dict[str, Any] = handler(self)
        for name in self.OPTIONAL:
            if data.get(name) is None:
                data.pop(name, None)
        return data


class AssistantMessage(_PlainWhenAbsent):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None  # the functions the answer calls (tools); then content is None
    reasoning_content: str | None = None  # a reasoning model's thinking (shared/reasoning.py), as vLLM returns it


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: CompletionUsage
    system_fingerprint: str | None = None


class ChatDelta(_PlainWhenAbsent):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None  # a streamed function call (gateway/openai_stream_tools.py)
    reasoning_content: str | None = None  # a reasoning model's thinking, streamed (shared/reasoning.py)


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: CompletionUsage | None = None
    system_fingerprint: str | None = None


def finish_reason(engine_reason: str | None) -> FinishReason | None:
    """The engine's `stop` | `length` | `abort` -> OpenAI's (an eos token or a stop string is `stop`)."""
    if engine_reason is None:
        return None
    return "length" if engine_reason == "length" else "stop"


def usage_of(prompt_tokens: int | None, completion_tokens: int, cached_tokens: int | None = None) -> CompletionUsage:
    prompt = prompt_tokens or 0
    return CompletionUsage(
        prompt_tokens=prompt, completion_tokens=completion_tokens, total_tokens=prompt + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens) if cached_tokens else None,
    )


def call_usage(usages: Sequence[Usage | CompletionUsage], num_choices: int) -> CompletionUsage:
    """A call's usage from its jobs' (prompt by prompt, `num_choices` each), as OpenAI counts it: each prompt's
    tokens once (and its cached ones: its first choice's), every choice's completion tokens."""
    firsts = usages[::num_choices]
    prompt_tokens = sum(usage.prompt_tokens or 0 for usage in firsts)
    return usage_of(prompt_tokens, sum(usage.completion_tokens for usage in usages), sum(_cached(u) for u in firsts))


def _cached(usage: Usage | CompletionUsage) -> int:
    if isinstance(usage, Usage):
        return usage.cached_tokens or 0
    return usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details is not None else 0


def completion_id(job_id: str) -> str:
    return f"cmpl-{job_id}"


def chat_completion_id(job_id: str) -> str:
    return f"chatcmpl-{job_id}"


def echoed_prompt(body: CompletionRequest, prompt_logprobs: list[TokenLogprob] | None) -> str | None:
    """The text `echo` puts before the answer: the prompt as given, or, given as token ids, its tokens' texts (the
    prompt's logprobs name them); None without echo."""
    if not body.echo:
        return None
    text = body.prompt_text()
    return text if text is not None else "".join(t.token for t in prompt_logprobs or [])


def completion_of(job: Job, model: str, echo_prompt: str | None = None) -> Completion:
    """The `text_completion` object of a finished job (with `echo`: its text, and logprobs, start with the
    prompt's)."""
    output = job.output
    logprobs = None
    if output is not None and output.logprobs is not None:
        logprobs = completion_logprobs([*(output.prompt_logprobs or []), *output.logprobs])
    return Completion(
        id=completion_id(job.id),
        created=int(job.created_at),
        model=model,
        choices=[
            CompletionChoice(
                text=(echo_prompt or "") + (output.text if output else ""),
                logprobs=logprobs,
                finish_reason=finish_reason(output.finish_reason if output else None),
            )
        ],
        usage=usage_of(job.usage.prompt_tokens, job.usage.completion_tokens, job.usage.cached_tokens),
    )


def chat_answer(
    job_id: str,
    text: str,
    reason: FinishReason | None,
    calls: CallReading | None,
    reasoning_parser: ReasoningParser = "none",
) -> tuple[AssistantMessage, FinishReason | None]:
    """The answer with its thinking apart (`reasoning_content`, shared/reasoning.py), then its content read as
    below (answer_of)."""
    reasoning, content = split_reasoning(text, reasoning_parser)
    message, reason = answer_of(job_id, content, reason, calls)
    message.reasoning_content = reasoning or None  # an empty thought (`<think></think>`): none, as a stream shows it
    return message, reason


def answer_of(
    job_id: str, text: str, reason: FinishReason | None, calls: CallReading | None
) -> tuple[AssistantMessage, FinishReason | None]:
    """A job's answer as a chat message, and its finish reason. Under active `tools` (`calls`, ToolSet.reading):
    a named function's answer
    is its call's arguments, whatever ended it (a `length` keeps its reason: the arguments are cut, as OpenAI
    and vLLM answer it); under `required` or `auto` an answer that ended by itself and reads as a call is one
    (finish reason `tool_calls`); anything else is text. A stream's chunks add up to the same message
    (gateway/openai_stream_tools.py reads its held text with this function)."""
    if calls is None:
        return AssistantMessage(content=text), reason
    if calls.named is not None:
        return AssistantMessage(content=None, tool_calls=tool_call_objects(job_id, [(calls.named, text)])), reason
    made = tool_calls_of(text, calls) if reason == "stop" else None
    if not made:
        return AssistantMessage(content=text), reason
    return AssistantMessage(content=None, tool_calls=tool_call_objects(job_id, made)), "tool_calls"


def chat_completion_of(
    job: Job, model: str, calls: CallReading | None = None, reasoning_parser: ReasoningParser = "none"
) -> ChatCompletion:
    """The `chat.completion` object of a finished job (its thinking apart, its answer read as function calls:
    `calls`)."""
    text = job.output.text if job.output else ""
    reason = finish_reason(job.output.finish_reason if job.output else None)
    message, reason = chat_answer(job.id, text, reason, calls, reasoning_parser)
    return ChatCompletion(
        id=chat_completion_id(job.id),
        created=int(job.created_at),
        model=model,
        choices=[
            ChatChoice(
                message=message,
                logprobs=chat_logprobs(job.output.logprobs) if job.output and job.output.logprobs is not None else None,
                finish_reason=reason,
            )
        ],
        usage=usage_of(job.usage.prompt_tokens, job.usage.completion_tokens, job.usage.cached_tokens),
    )


def completion_response(job: Job, model: str) -> dict[str, Any]:
    return completion_of(job, model).model_dump(mode="json")


def chat_completion_response(
    job: Job, model: str, calls: CallReading | None = None, reasoning_parser: ReasoningParser = "none"
) -> dict[str, Any]:
    return chat_completion_of(job, model, calls, reasoning_parser).model_dump(mode="json")


def response_body(
    url: str, job: Job, model: str, calls: CallReading | None = None, reasoning_parser: ReasoningParser = "none"
) -> dict[str, Any]:
    """What the endpoint at `url` answers for a finished job (the job itself for /v1/jobs; a chat's answer with
    its thinking apart and read as function calls: `calls`)."""
    if url == COMPLETIONS_URL:
        return completion_response(job, model)
    if url == CHAT_COMPLETIONS_URL:
        return chat_completion_response(job, model, calls, reasoning_parser)
    return job.model_dump(mode="json")


__all__ = ["ValidationError", "job_request_for", "response_body", "model_of"]
