"""OpenAI's Responses API, its input items: messages (text content or `input_text`/`output_text` parts),
`function_call` and `function_call_output` items, and `reasoning` items (sent back, dropped from the prompt); each
validated with a reason that names it (`input[i]`, a part's index), and the conversation they make as the chat
route's messages (`chat_messages`)."""

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from shared.openai_compat import ChatMessage
from shared.response_format import FUNCTION_NAME_PATTERN, ToolCall, ToolCallFunction


# -- input items ---------------------------------------------------------------------------------------------------
class Strict(BaseModel):
    """A part of OpenAI's request: a field it does not know is refused."""

    model_config = ConfigDict(extra="forbid")


class TextContent(Strict):
    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None  # an output_text sent back: kept as it came, read for its text only
    logprobs: list[Any] | None = None


class MessageItem(Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[TextContent]
    id: str | None = Field(None, max_length=256)
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    @property
    def text(self) -> str:
        return _joined(self.content)


class FunctionCallItem(Strict):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1, max_length=256)
    name: str = Field(pattern=FUNCTION_NAME_PATTERN)
    arguments: str
    id: str | None = Field(None, max_length=256)
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallOutputItem(Strict):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1, max_length=256)
    output: str | list[TextContent]
    id: str | None = Field(None, max_length=256)
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    @property
    def text(self) -> str:
        return _joined(self.output)


def _joined(value: str | list[TextContent]) -> str:
    """An item's text: a string as it is, text parts one after another."""
    return value if isinstance(value, str) else "".join(part.text for part in value)


class ReasoningItem(Strict):
    type: Literal["reasoning"]
    id: str | None = Field(None, max_length=256)
    summary: list[Any] = Field(default_factory=list)
    content: list[Any] | None = None
    encrypted_content: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem
_ITEM_TYPES: dict[str, type[Strict]] = {
    "message": MessageItem,
    "function_call": FunctionCallItem,
    "function_call_output": FunctionCallOutputItem,
    "reasoning": ReasoningItem,
}
_TEXT_PARTS = ("input_text", "output_text")


def item_of(i: int, raw: Any) -> Any:
    """One input item, its kind read from `type` (a message may leave it out) -> the typed item's input; a kind
    or a part that is not text is named."""
    if not isinstance(raw, dict):
        raise ValueError(f"input[{i}]: an item is an object")
    kind = raw.get("type", "message" if "role" in raw else None)
    if not isinstance(kind, str) or kind not in _ITEM_TYPES:
        raise ValueError(
            f"input[{i}]: items of type `{kind}` are not supported (messages, function_call and "
            "function_call_output items are)"
        )
    for field in ("content", "output"):
        parts = raw.get(field)
        for j, part in enumerate(parts if isinstance(parts, list) and kind != "reasoning" else []):
            part_kind = part.get("type") if isinstance(part, dict) else None
            if part_kind not in _TEXT_PARTS:
                raise ValueError(f"input[{i}].{field}[{j}]: parts of type `{part_kind}` are not supported (the models read text)")
    return _ITEM_TYPES[kind].model_validate({**raw, "type": kind})


def items_of(raw: list[Any]) -> list[InputItem]:
    """Input items from their JSON (a stored conversation's)."""
    return [item_of(i, item) for i, item in enumerate(raw)]


def chat_messages(items: list[InputItem]) -> list[ChatMessage]:
    """A conversation's items as chat messages: consecutive function calls are one assistant message's
    `tool_calls`, each output a `tool` message; thoughts are left out."""
    messages: list[ChatMessage] = []
    for item in items:
        if isinstance(item, MessageItem):
            messages.append(ChatMessage.model_validate({"role": item.role, "content": item.text}))
        elif isinstance(item, FunctionCallItem):
            call = ToolCall(id=item.call_id, function=ToolCallFunction(name=item.name, arguments=item.arguments))
            last = messages[-1] if messages else None
            if last is not None and last.role == "assistant" and last.tool_calls is not None:
                last.tool_calls.append(call)
            else:
                messages.append(ChatMessage.model_validate({"role": "assistant", "tool_calls": [call]}))
        elif isinstance(item, FunctionCallOutputItem):
            messages.append(ChatMessage.model_validate({"role": "tool", "tool_call_id": item.call_id, "content": item.text}))
    return messages
