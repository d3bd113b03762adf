"""Structured output: OpenAI's `response_format` and `tools`, turned into one grammar the engine enforces.

`ResponseFormat` is what a request may ask: `text` (no constraint), `json_object` (any JSON object) or
`json_schema` (an object of the given JSON schema; `strict` is accepted: the engine always constrains, so every
answer follows the schema). `grammar_of` compiles it to llguidance's grammar (its JSON-schema compiler, compact
separators so a model cannot pad its answer with whitespace forever) and checks it without a tokenizer: a
schema llguidance cannot compile is a ValueError naming the problem, raised while the request is validated,
so the gateway answers 400 before the job is queued. The worker hands the same grammar string to the engine
(SamplingParams.grammar, workers/engine/grammar.py).

`tools` + `tool_choice` (chat) become a `json_schema` format: a named function constrains the answer to that
function's `parameters` (the answer is its arguments); `required` to `{"name": <one of the tools>, "arguments":
<its parameters>}`; `auto` leaves the answer free and reads it back as a call when it is such an object;
`none` ignores the tools. `tool_calls_of` turns an answer into OpenAI's `tool_calls`; on a stream,
`ToolCallDelta` carries a call in pieces (gateway/openai_stream_tools.py).
"""

import json
from typing import TYPE_CHECKING, Any, Literal

import llguidance

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions  # a TypedDict of the type stubs only
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    StrictBool,
    field_validator,
    model_serializer,
    model_validator,
)

MAX_SCHEMA_CHARS = 64 * 1024  # a schema (as JSON) past this is refused: compiling it costs the worker
# compact JSON: no free whitespace (a model looping on spaces would never close its object)
JSON_OPTIONS: "JsonCompileOptions" = {"whitespace_flexible": False}
FUNCTION_NAME_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"  # OpenAI's


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: str = Field(pattern=FUNCTION_NAME_PATTERN)
    description: str | None = Field(None, max_length=4096)
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's `response_format`."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _compiles(self) -> "ResponseFormat":
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format of type json_schema needs `json_schema`")
        if self.type != "json_schema" and self.json_schema is not None:
            raise ValueError(f"response_format of type {self.type} takes no `json_schema`")
        grammar_of(self)  # raises ValueError naming the problem
        return self

    def answer_schema(self) -> dict[str, Any] | None:
        """The JSON schema the answer must follow; None for free text."""
        if self.type == "json_object":
            return {"type": "object"}
        if self.type == "json_schema":
            assert self.json_schema is not None
            return self.json_schema.schema_
        return None


def grammar_of(fmt: ResponseFormat | None) -> str | None:
    """llguidance's grammar (a JSON string) for `fmt`; None = unconstrained. ValueError when it does not compile."""
    schema = fmt.answer_schema() if fmt is not None else None
    if schema is None:
        return None
    if len(json.dumps(schema)) > MAX_SCHEMA_CHARS:
        raise ValueError(f"the JSON schema is over {MAX_SCHEMA_CHARS} characters")
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
    except Exception as exc:  # whatever a hostile schema makes it raise is the client's 400, never a 500
        raise ValueError(f"invalid JSON schema: {exc}") from exc
    return _checked(grammar, "JSON schema")


def _checked(grammar: str, what: str) -> str:
    """`grammar` when llguidance compiles it; else ValueError naming `what` and the problem."""
    try:
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    except Exception as exc:  # whatever a hostile grammar makes it raise is the client's 400, never a 500
        raise ValueError(f"invalid {what}: {exc}") from exc
    if is_error:
        raise ValueError(f"invalid {what}: {messages[0] if messages else 'it does not compile'}")
    return grammar


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs` (its older `guided_json`, `guided_regex`, `guided_choice` and `guided_grammar`
    fields mean the same): the answer matches a regular expression (Rust `regex` syntax, whole answer), is one of
    the given strings, is derived from a Lark grammar (llguidance's dialect, `start` rule), or is a JSON value of
    the given schema. Exactly one. Compiled by llguidance while the request is validated (a 400 naming the
    problem before any job), then enforced by the engine exactly as a `response_format` is."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    json_schema: dict[str, Any] | None = Field(None, alias="json")
    regex: str | None = Field(None, min_length=1, max_length=MAX_SCHEMA_CHARS)
    choice: list[str] | None = Field(None, min_length=1, max_length=1024)
    grammar: str | None = Field(None, min_length=1, max_length=MAX_SCHEMA_CHARS)

    @model_validator(mode="after")
    def _one_that_compiles(self) -> "StructuredOutputs":
        given = [name for name in ("json_schema", "regex", "choice", "grammar") if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError("give exactly one of `json`, `regex`, `choice` or `grammar`")
        if self.choice is not None and (any(not c for c in self.choice) or len(set(self.choice)) != len(self.choice)):
            raise ValueError("choice: the strings must be distinct and not empty")
        self.compiled()  # raises ValueError naming the problem
        return self

    def compiled(self) -> str:
        """llguidance's grammar for it."""
        if self.json_schema is not None:
            return grammar_of(ResponseFormat.model_validate(
                {"type": "json_schema", "json_schema": {"name": "structured_outputs", "schema": self.json_schema}}
            )) or ""  # fmt: skip
        if self.regex is not None:
            return _checked(llguidance.LLMatcher.grammar_from_regex(self.regex), "regex")
        if self.choice is not None:  # Lark string literals take JSON's escapes
            alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in self.choice)
            return _checked(llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}"), "choice")
        assert self.grammar is not None
        return _checked(llguidance.LLMatcher.grammar_from_lark(self.grammar), "grammar")


def answer_grammar(fmt: ResponseFormat | None, structured: StructuredOutputs | None) -> str | None:
    """The grammar a request's answer follows (its `structured_outputs`, else its `response_format`); None = free."""
    return structured.compiled() if structured is not None else grammar_of(fmt)


# -- tools ------------------------------------------------------------------------------------------------------
class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=FUNCTION_NAME_PATTERN)
    description: str | None = Field(None, max_length=4096)
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: StrictBool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: FunctionDef


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ToolSet(BaseModel):
    """A chat request's tools and its choice among them (OpenAI's default: `auto` when tools are given)."""

    tools: list[Tool] = Field(min_length=1, max_length=128)
    tool_choice: ToolChoice = "auto"

    @field_validator("tools")
    @classmethod
    def _unique_names(cls, tools: list[Tool]) -> list[Tool]:
        names = [t.function.name for t in tools]
        if len(set(names)) != len(names):
            raise ValueError("tools: function names must be unique")
        return tools

    @model_validator(mode="after")
    def _choice_names_a_tool(self) -> "ToolSet":
        if isinstance(self.tool_choice, NamedToolChoice) and self.named() is None:
            raise ValueError(f"tool_choice names `{self.tool_choice.function.name}`, which is not in tools")
        self.response_format()  # every function's parameters must compile
        return self

    def named(self) -> FunctionDef | None:
        """The function tool_choice names, if it names one."""
        if not isinstance(self.tool_choice, NamedToolChoice):
            return None
        return next((t.function for t in self.tools if t.function.name == self.tool_choice.function.name), None)

    @property
    def is_active(self) -> bool:
        """False for `none`: the tools change nothing."""
        return self.tool_choice != "none"

    def response_format(self) -> ResponseFormat | None:
        """The constraint the choice puts on the answer; None for `auto` and `none` (free text)."""
        named = self.named()
        if named is not None:
            schema = named.parameters
        elif self.tool_choice == "required":
            schema = {"anyOf": [_call_schema(t.function) for t in self.tools]}
        else:
            return None
        try:
            return ResponseFormat.model_validate(
                {"type": "json_schema", "json_schema": {"name": "tool_call", "schema": schema}}
            )
        except ValueError as exc:
            raise ValueError(f"tools: {exc}") from exc

    def reading(self) -> "CallReading | None":
        """How an answer is read back as calls under this choice; None for `none` (it is text)."""
        if not self.is_active:
            return None
        named = self.named()
        return CallReading(named=named.name if named is not None else None, names=[t.function.name for t in self.tools])

    def prompt_note(self) -> str:
        """A system message telling the model which functions it may call, and how."""
        specs = [t.function.model_dump(exclude_none=True) for t in self.tools]
        return 'Functions you may call, answering {"name":...,"arguments":{...}}: ' + json.dumps(
            specs, separators=(",", ":")
        )


def _call_schema(fn: FunctionDef) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"name": {"const": fn.name}, "arguments": fn.parameters},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


class CallReading(BaseModel):
    """What reading an answer as function calls needs of its ToolSet (small: a batch line keeps it until its
    result is written, shared/batch_format.py): the function a named choice forces, or the names an answer may
    call under `auto` and `required`."""

    named: str | None = None
    names: list[str]


def could_be_call(text: str) -> bool:
    """Whether an answer beginning with `text` may still read as a call under `auto` or `required`: nothing but
    whitespace yet, or an object begun (a JSON object's first character is `{`; str.lstrip strips every
    whitespace json.loads skips, and more, so a False here is a text that never parses as a call)."""
    rest = text.lstrip()
    return not rest or rest.startswith("{")


def tool_calls_of(text: str, reading: CallReading) -> list[tuple[str, str]] | None:
    """(function name, arguments as a JSON string) of the call an answer makes under `auto` or `required`;
    None = the answer is text. (A named function's answer is its arguments: shared/openai_compat.chat_answer.)"""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if not isinstance(value, dict) or value.get("name") not in reading.names or not isinstance(value.get("arguments"), dict):
        return None
    return [(value["name"], json.dumps(value["arguments"]))]


# -- the answer -------------------------------------------------------------------------------------------------
class ToolCallFunction(BaseModel):
    name: str
    arguments: str  # JSON, as OpenAI sends it


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


def tool_call_id(job_id: str, index: int) -> str:
    """A call's id, derived from its job's, so a re-read (or the stream) gives the same one."""
    return f"call_{job_id}_{index}"


def tool_call_objects(job_id: str, calls: list[tuple[str, str]]) -> list[ToolCall]:
    """OpenAI's `tool_calls` of a job's answer."""
    return [
        ToolCall(id=tool_call_id(job_id, i), function=ToolCallFunction(name=name, arguments=arguments))
        for i, (name, arguments) in enumerate(calls)
    ]


# -- the answer on a stream: each call's chunks (OpenAI sends a field only where it has one) ----------------------
class ToolCallDeltaFunction(BaseModel):
    name: str | None = None
    arguments: str | None = None

    @model_serializer(mode="wrap")
    def _set_fields_only(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ToolCallDelta(BaseModel):
    index: int  # which call of the answer this chunk extends
    id: str | None = None  # the call's first chunk: its id, type and name
    type: Literal["function"] | None = None
    function: ToolCallDeltaFunction

    @model_serializer(mode="wrap")
    def _set_fields_only(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}

    @classmethod
    def opening(cls, index: int, call_id: str, name: str, arguments: str) -> "ToolCallDelta":
        return cls(index=index, id=call_id, type="function", function=ToolCallDeltaFunction(name=name, arguments=arguments))

    @classmethod
    def more_arguments(cls, index: int, arguments: str) -> "ToolCallDelta":
        return cls(index=index, function=ToolCallDeltaFunction(arguments=arguments))
