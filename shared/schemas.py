"""The API and job schemas: what clients send, what they get back, and the events of a job's stream."""

from collections.abc import Mapping, Sequence
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    JsonValue,
    StringConstraints,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from shared import chat_template
from shared.job_state import JobStatus
from shared.logprobs import MAX_TOP_LOGPROBS, TokenLogprob
from shared.response_format import ResponseFormat, StructuredOutputs
from shared.speculation import SpeculativeMethod

MAX_METADATA_KEYS = 16
MAX_METADATA_VALUE_CHARS = 512
MODEL_VERSION_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:@+-]{0,63}$"  # `demo-v3@2`, `llama-8b:2026-11-30`
MAX_TIMEOUT_S = 7 * 24 * 3600.0  # the longest execution deadline a job may ask (`timeout_s`, `Cancel-After`)
MAX_STREAM_INTERVAL_MS = 60_000  # the longest a job may ask its token events apart (`stream_interval_ms`)
MIN_SEED, MAX_SEED = -(2**63), 2**64 - 1  # what torch's generators take (a 64-bit seed, either sign)
MAX_TOP_K = 2**63 - 1  # the engine holds top_k in a 64-bit tensor; any k >= the vocabulary keeps every token
MAX_TOKEN_ID = 2**31 - 1  # a prompt's token ids (`prompt_token_ids`): the model's vocabulary bounds them further
TokenId = Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]
MAX_LOGIT_BIAS_TOKENS = 300  # OpenAI's bound on a request's logit_bias entries
MAX_REPETITION_PENALTY = 10.0  # vLLM's repetition_penalty is any positive number; past this a token is banned anyway
# OpenAI's logit_bias: token id (a JSON object's keys are strings: "50256") -> a bias in [-100, 100]
LogitBias = dict[TokenId, Annotated[float, Field(ge=-100.0, le=100.0)]]
MAX_ALLOWED_TOKEN_IDS = 10_000  # vLLM's allowed_token_ids: a request's list of the tokens it may sample


class Priority(StrEnum):
    """Queue priorities, highest first (the order a worker reads the queue streams in)."""

    INTERACTIVE = "interactive"
    DEFAULT = "default"
    BATCH = "batch"


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant"]
    content: str


class WebhookEvent(StrEnum):
    """Events a job's webhook may receive (Replicate's `webhook_events_filter`)."""

    START = "start"  # the job started running
    OUTPUT = "output"  # new output (throttled: settings.webhook_output_interval_ms)
    COMPLETED = "completed"  # any terminal status: succeeded, failed, cancelled, expired


WebhookUrl = Annotated[str, StringConstraints(min_length=1, max_length=2048, pattern=r"^https?://")]


class WebhookTarget(BaseModel):
    """A job's webhook, read alone from its stored request (JobRequest's own two fields; the rest ignored): the
    webhook of a job whose whole request would not validate any more is still called."""

    model_config = ConfigDict(extra="ignore")
    webhook: WebhookUrl | None = None
    webhook_events_filter: list[WebhookEvent] = Field(default_factory=lambda: list(WebhookEvent))


class WebhookDelivery(BaseModel):
    """The outcome of one webhook event's delivery (`webhook_status[event]` of a job or batch)."""

    state: Literal["delivered", "failed", "gone"]  # gone: the receiver answered 410 (no more retries)
    attempts: int
    status_code: int | None = None  # of the last attempt; None when it got no HTTP answer
    message: str | None = None  # why the last attempt failed
    at: float  # unix seconds of the last attempt


def speculation_choice(value: Any) -> Any:
    """A `speculative` field's value, or one message for the union (pydantic's names its first branch:
    `speculative.bool: ...`)."""
    if isinstance(value, bool) or (isinstance(value, str) and value in {m.value for m in SpeculativeMethod}):
        return value
    choices = ", ".join(m.value for m in SpeculativeMethod)
    raise ValueError(f"must be true (the worker's default method), false, or one of {choices}; got {value!r}")


class JobRequest(BaseModel):
    """Body of `POST /v1/jobs`: a prompt or chat messages, sampling parameters and queueing options. A number
    must be finite (Python's JSON reads NaN and Infinity, which every bound would let through or misname)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    prompt: str | None = None
    messages: list[Message] | None = Field(None, min_length=1)
    prompt_token_ids: list[TokenId] | None = Field(None, min_length=1)  # the prompt already tokenized (OpenAI's too)
    # vLLM's chat-template controls, with `messages` only (shared/chat_template.py)
    add_generation_prompt: bool = True  # the prompt opens the assistant's turn
    continue_final_message: bool = False  # the answer goes on from the last message, the assistant's
    chat_template_kwargs: dict[str, JsonValue] | None = Field(None, max_length=chat_template.MAX_KWARGS)
    max_tokens: int = Field(256, ge=1, le=1_000_000)
    temperature: float = Field(1.0, ge=0.0, le=10.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1, le=MAX_TOP_K)
    min_p: float = Field(0.0, ge=0.0, le=1.0)  # vLLM's: drop tokens less likely than min_p x the likeliest; 0 = off
    seed: int | None = Field(None, ge=MIN_SEED, le=MAX_SEED)
    stop: list[str] = Field(default_factory=list, max_length=16)
    include_stop_str_in_output: bool = False  # vLLM's: the output ends with the stop string it met (else before it)
    skip_special_tokens: bool = True  # vLLM's: False leaves special tokens' text (EOS, chat markers) in the output
    stop_token_ids: list[TokenId] = Field(default_factory=list, max_length=64)  # vLLM's: these tokens end it too
    min_tokens: int = Field(0, ge=0, le=1_000_000)  # vLLM's: no EOS, stop_token_ids nor stop string before this many tokens
    ignore_eos: bool = False
    # False: plain decoding; True: the engine's default method; or a method name ("none" | "draft" | "ngram" | "eagle").
    speculative: bool | SpeculativeMethod = True
    # structured output (OpenAI's shape): json_object / json_schema constrain the output; text or None: free
    response_format: ResponseFormat | None = None
    # vLLM's: a regex, a choice of strings, a Lark grammar or a JSON schema the output follows (not with a
    # response_format that constrains it)
    structured_outputs: StructuredOutputs | None = None
    # only a worker serving this model version (settings.model_version) takes the job; None: any worker
    model_version: str | None = Field(None, pattern=MODEL_VERSION_PATTERN)
    priority: Priority = Priority.DEFAULT
    ttl_s: float | None = Field(None, gt=0.0)  # must start within this many seconds, else `expired`
    # execution deadline, counted from the job's creation (Replicate's `Cancel-After`): a job still running
    # then fails with code `timeout`, keeping its output; None: settings.job_timeout_s from its first start
    timeout_s: float | None = Field(None, gt=0.0, le=MAX_TIMEOUT_S)
    # the job's token events come at most once per this many ms, each with the tokens since the last (the first
    # token and the end come at once: workers/worker/stream_interval.py); None: the worker's
    # settings.stream_interval_ms; 0: every engine step
    stream_interval_ms: int | None = Field(None, ge=0, le=MAX_STREAM_INTERVAL_MS)
    metadata: dict[str, str] = Field(default_factory=dict)
    # POSTed the job (as GET returns it), signed per Standard Webhooks; the host must be public (shared/ssrf.py)
    webhook: WebhookUrl | None = None
    webhook_events_filter: list[WebhookEvent] = Field(default_factory=lambda: list(WebhookEvent))
    # the target's logprobs (shared/logprobs.py): of each output token with N alternatives, of each prompt token
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    # added to the target's logits of these tokens wherever it samples (workers/engine/logit_bias.py); the
    # worker checks the ids against its model's vocabulary
    logit_bias: LogitBias | None = Field(None, max_length=MAX_LOGIT_BIAS_TOKENS)
    # vLLM's: the only tokens the target may sample (workers/engine/allowed_tokens.py); the worker checks them too
    allowed_token_ids: list[TokenId] | None = Field(None, min_length=1, max_length=MAX_ALLOWED_TOKEN_IDS)
    # vLLM's: the worker's prefix cache shares blocks only among requests with the same salt
    cache_salt: str | None = Field(None, min_length=1, max_length=256)
    # OpenAI's penalties on tokens the output already has, and vLLM's on the prompt's and output's (CTRL's):
    # workers/engine/penalties.py; 0, 0 and 1 are off
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=MAX_REPETITION_PENALTY)

    @model_validator(mode="after")
    def _one_input(self) -> "JobRequest":
        if sum(given is not None for given in (self.prompt, self.messages, self.prompt_token_ids)) != 1:
            raise ValueError("give exactly one of `prompt`, `messages` or `prompt_token_ids`")
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if self.structured_outputs is not None and self.response_format is not None and self.response_format.type != "text":
            raise ValueError("give one of `structured_outputs` or a `response_format` that constrains the output")
        return self

    @field_validator("prompt")
    @classmethod
    def _non_empty_prompt(cls, value: str | None) -> str | None:
        # not Field(min_length=1): a length constraint makes pydantic refuse a lone surrogate first, with a
        # vaguer message than the gateway's own Unicode check (gateway/admission.py)
        if value == "":
            raise ValueError("the prompt must not be empty: it gives the model nothing to continue")
        return value

    @field_validator("speculative", mode="before")
    @classmethod
    def _speculation_choice(cls, value: Any) -> Any:
        return speculation_choice(value)

    @field_validator("add_generation_prompt", "continue_final_message", "chat_template_kwargs")
    @classmethod
    def _chat_template_controls(cls, value: Any, info: ValidationInfo) -> Any:
        """With `messages` only (a failed `messages` is not in info.data: its own error says enough)."""
        default = cls.model_fields[str(info.field_name)].default
        if "messages" in info.data and info.data["messages"] is None and value != default:
            raise ValueError("applies to `messages` only (the chat template renders them)")
        if info.field_name == "continue_final_message" and "messages" in info.data and info.data["messages"]:
            chat_template.check_continuation(value, info.data.get("add_generation_prompt", True),
                                             info.data["messages"][-1].role)  # fmt: skip
        if info.field_name == "chat_template_kwargs":
            return chat_template.checked_kwargs(value)
        return value

    @field_validator("stop")
    @classmethod
    def _non_empty_stops(cls, value: list[str]) -> list[str]:
        if any(s == "" for s in value):  # the engine refuses it; refused here, the job is never queued
            raise ValueError("stop strings must not be empty")
        return value

    @field_validator("metadata")
    @classmethod
    def _small_metadata(cls, value: dict[str, str]) -> dict[str, str]:
        if len(value) > MAX_METADATA_KEYS:
            raise ValueError(f"at most {MAX_METADATA_KEYS} metadata keys")
        if any(len(v) > MAX_METADATA_VALUE_CHARS or len(k) > 64 for k, v in value.items()):
            raise ValueError(f"metadata keys are at most 64 and values {MAX_METADATA_VALUE_CHARS} characters")
        return value

    @property
    def speculative_method(self) -> SpeculativeMethod | None:
        """What the engine's SamplingParams.speculative takes: None is the engine's default."""
        if self.speculative is True:
            return None
        if self.speculative is False:
            return SpeculativeMethod.NONE
        return self.speculative


class StoredRequestError(ValueError):
    """A job's request, read back from Redis, that does not validate now: stored by another version of specfleet
    (a bound tightened since) or altered in Redis. Its job fails with this; whoever read it goes on."""

    def __init__(self, field: str | None, message: str) -> None:
        super().__init__(message)
        self.field = field
        self.message = message


def first_error(errors: Sequence[Mapping[str, Any]]) -> tuple[tuple[int | str, ...], str]:
    """The first of pydantic's errors: its location, and its reason in the validator's own words."""
    first = errors[0] if errors else {}
    return tuple(first.get("loc", ())), str(first.get("msg", "invalid value")).removeprefix("Value error, ")


def stored_request(raw: str | bytes) -> JobRequest:
    """A job's stored request (its hash's `request`), validated as the gateway validated it: StoredRequestError."""
    try:
        return JobRequest.model_validate_json(raw)
    except ValidationError as exc:
        loc, reason = first_error(exc.errors())
        field = ".".join(str(part) for part in loc) or None
        raise StoredRequestError(
            field,
            f"the job's stored request does not validate here ({field or 'request'}: {reason}): it was written by "
            "another version of specfleet, or changed in Redis; submit it again",
        ) from exc


class ErrorInfo(BaseModel):
    code: str
    message: str
    field: str | None = None  # the offending request field, for 422


class ErrorResponse(BaseModel):
    """The one error shape of every non-2xx answer."""

    error: ErrorInfo


class JobOutput(BaseModel):
    text: str = ""
    token_ids: list[int] = Field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "abort"; None while running
    # with the request's logprobs / prompt_logprobs, once the job succeeded: one per token_ids / prompt token
    # (left out of the answer of a job that did not ask)
    logprobs: list[TokenLogprob] | None = Field(None, exclude_if=lambda value: value is None)
    prompt_logprobs: list[TokenLogprob] | None = Field(None, exclude_if=lambda value: value is None)


class Usage(BaseModel):
    prompt_tokens: int | None = None
    completion_tokens: int = 0
    cached_tokens: int | None = None  # of the prompt tokens, those the worker's prefix cache held (None: none)


class JobMetrics(BaseModel):
    ttft_ms: float | None = None
    tokens_per_s: float | None = None
    mean_accepted_tokens: float | None = None
    acceptance_rate: float | None = None  # of the draft tokens verified (0 when none were: see num_draft_tokens)
    num_draft_tokens: int | None = None  # draft tokens the target verified (0: the engine decoded plainly)
    # of the draft tokens the target judged (each path up to its first rejection), the share it rejected: 1 - alpha
    draft_rejection_rate: float | None = None
    # the counts behind the rates, so that a fleet's rates are pooled over jobs (shared/validation.py): target
    # passes that verified drafts, draft tokens accepted, and draft tokens rejected (at most one a path)
    num_spec_steps: int | None = None
    num_accepted_tokens: int | None = None
    num_rejected_tokens: int | None = None
    compute_s: float | None = None  # this job's share of engine time (each step split by scheduled tokens)
    cost: float | None = None  # compute_s priced at settings.price_per_worker_hour (its currency)


class JobUrls(BaseModel):
    get: str
    stream: str
    cancel: str


class Job(BaseModel):
    id: str
    status: JobStatus
    priority: Priority
    created_at: float  # unix seconds
    started_at: float | None = None
    completed_at: float | None = None
    expires_at: float | None = None  # not started by then -> `expired`
    output: JobOutput | None = None  # partial while running
    error: ErrorInfo | None = None
    usage: Usage = Field(default_factory=Usage)  # a factory: a model default is deep-copied per instance (12 µs a Job)
    metrics: JobMetrics = Field(default_factory=JobMetrics)
    metadata: dict[str, str] = Field(default_factory=dict)
    model_version: str | None = None  # the version of the worker that (last) ran it
    urls: JobUrls
    webhook_status: dict[WebhookEvent, WebhookDelivery] | None = None  # event -> its latest delivery


class JobList(BaseModel):
    """GET /v1/jobs: a page of the key's jobs, newest first (OpenAI's list shape)."""

    object: Literal["list"] = "list"
    data: list[Job]
    first_id: str | None
    last_id: str | None
    has_more: bool


class TokenEvent(BaseModel):
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None  # with the request's logprobs: one per token_ids
    prompt_logprobs: list[TokenLogprob] | None = None  # with prompt_logprobs: on the first token event


class DoneEvent(BaseModel):
    status: JobStatus
    finish_reason: str | None
    usage: Usage
    metrics: JobMetrics


class ErrorEvent(BaseModel):
    status: JobStatus
    error: ErrorInfo


class EventType(StrEnum):
    STATUS = "status"
    TOKEN = "token"
    DONE = "done"
    ERROR = "error"

    @property
    def is_final(self) -> bool:
        return self in (EventType.DONE, EventType.ERROR)


def metrics_from(raw: dict[str, Any]) -> JobMetrics:
    """Keep the engine's per-job metrics that the API names; drop the rest."""
    return JobMetrics.model_validate({k: v for k, v in raw.items() if k in JobMetrics.model_fields})
