"""Function calls on chat streams (gateway/openai_stream_tools.py): whatever a choice's text and however its
tokens split it, the chunks add up to the message the call answers without `stream`
(shared/openai_compat.chat_answer), with the same finish reason; a named call streams its arguments as they
come, an `auto` text that cannot be a call streams at once."""

import itertools
import json
from typing import Any

import pytest

from gateway.openai_stream_tools import ToolCallStream
from shared import openai_compat as oa
from shared.response_format import CallReading, ToolSet, could_be_call

PARAMS = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_time", "parameters": PARAMS}},
    {"type": "function", "function": {"name": "get_date", "parameters": PARAMS}},
]
CHOICES: list[Any] = ["auto", "required", {"type": "function", "function": {"name": "get_time"}}]
TEXTS = [
    '{"name":"get_time","arguments":{"zone":"UTC"}}',  # a call under auto and required
    ' \n{"name": "get_date", "arguments": {"zone": "CET"}} ',  # whitespace around it: still one
    '{"zone":"UTC"}',  # a named call's arguments; under auto, an object that is no call: text
    '{"name":"get_time","arguments":{"zone":',  # cut
    '{"name":"nope","arguments":{}}',  # no such tool: text
    "The time is noon.",
    "  {not json",
    "",
    "   ",
]


def _splits(text: str) -> list[list[str]]:
    """The text as one piece, as single characters, and cut in three."""
    third = max(1, len(text) // 3)
    return [[text], list(text), [text[:third], text[third : 2 * third], text[2 * third :]]]


def _accumulate(deltas: list[oa.ChatDelta]) -> dict[str, Any]:
    """What a client makes of a choice's deltas (as the openai SDK's stream accumulator): content concatenated,
    each call by index, its arguments concatenated."""
    content: str | None = None
    reasoning: str | None = None
    calls: dict[int, dict[str, Any]] = {}
    for delta in deltas:
        wire = json.loads(delta.model_dump_json())  # what goes out: null fields dropped where OpenAI drops them
        if wire.get("content") is not None:
            content = (content or "") + wire["content"]
        if wire.get("reasoning_content") is not None:
            reasoning = (reasoning or "") + wire["reasoning_content"]
        for piece in wire.get("tool_calls") or []:
            call = calls.setdefault(piece["index"], {"function": {"arguments": ""}})
            for name in ("id", "type"):
                if name in piece:
                    call[name] = piece[name]
            if "name" in piece["function"]:
                call["function"]["name"] = piece["function"]["name"]
            call["function"]["arguments"] += piece["function"].get("arguments", "")
    answer = {"content": content, "tool_calls": [calls[i] for i in sorted(calls)] or None}
    return {**answer, "reasoning_content": reasoning} if reasoning is not None else answer


def _reading(choice: Any) -> CallReading:
    reading = ToolSet.model_validate({"tools": TOOLS, "tool_choice": choice}).reading()
    assert reading is not None
    return reading


def _streamed(calls: CallReading, pieces: list[str], reason: oa.FinishReason) -> tuple[dict[str, Any], Any]:
    stream = ToolCallStream(calls, "job1")
    deltas = [d for piece in pieces if piece and (d := stream.on_text(piece)) is not None]
    last, final_reason = stream.on_done(reason)
    return _accumulate(deltas + ([last] if last is not None else [])), final_reason


@pytest.mark.parametrize("choice", CHOICES, ids=["auto", "required", "named"])
def test_the_chunks_add_up_to_the_answer_without_stream(choice: Any) -> None:
    tools = _reading(choice)
    for text, reason in itertools.product(TEXTS, ("stop", "length")):
        message, want_reason = oa.chat_answer("job1", text, reason, tools)  # type: ignore[arg-type]
        want = message.model_dump(mode="json", exclude={"role"})
        want.setdefault("tool_calls", None)
        if want["content"] == "":  # a text answer's role chunk carries no content: empty and absent read the same
            want["content"] = None
        for pieces in _splits(text):
            got, got_reason = _streamed(tools, pieces, reason)  # type: ignore[arg-type]
            assert (got, got_reason) == (want, want_reason), (choice, text, pieces, reason)


def test_a_named_call_streams_its_arguments_as_they_come() -> None:
    tools = _reading(CHOICES[2])
    stream = ToolCallStream(tools, "job1")
    first, second = stream.on_text('{"zone":'), stream.on_text('"UTC"}')
    assert first is not None and second is not None
    assert json.loads(first.model_dump_json())["tool_calls"] == [
        {"index": 0, "id": "call_job1_0", "type": "function", "function": {"name": "get_time", "arguments": '{"zone":'}}
    ]
    assert json.loads(second.model_dump_json())["tool_calls"] == [{"index": 0, "function": {"arguments": '"UTC"}'}}]
    assert stream.on_done("stop") == (None, "stop")  # as OpenAI ends a forced call
    cut = ToolCallStream(tools, "job2")
    assert cut.on_text('{"zo') is not None and cut.on_done("length") == (None, "length")


def test_auto_text_streams_at_once_and_a_call_comes_whole() -> None:
    tools = _reading("auto")
    text = ToolCallStream(tools, "job1")
    assert text.on_text("  ") is None  # could still open a call
    delta = text.on_text("The")
    assert delta is not None and delta.content == "  The" and text.on_text(" time") == oa.ChatDelta(content=" time")
    call = ToolCallStream(tools, "job1")
    assert call.on_text('{"name":"get_time",') is None and call.on_text('"arguments":{"zone":"UTC"}}') is None
    last, reason = call.on_done("stop")
    assert reason == "tool_calls" and last is not None and last.tool_calls is not None
    assert last.tool_calls[0].function.arguments == '{"zone": "UTC"}' and last.tool_calls[0].id == "call_job1_0"


def test_could_be_call() -> None:
    assert ToolSet.model_validate({"tools": TOOLS, "tool_choice": "none"}).reading() is None  # text, read as such
    assert could_be_call("") and could_be_call(" \n\t") and could_be_call(' {"a') and could_be_call("\x0c{")
    assert not could_be_call("a{") and not could_be_call(" [") and not could_be_call("\ufeff{")  # json.loads refuses a BOM


def test_a_named_call_cut_by_length_is_still_a_call() -> None:
    """As OpenAI and vLLM answer it: the call with its arguments cut, finish reason `length`."""
    message, reason = oa.chat_answer("job1", '{"zone":"U', "length", _reading(CHOICES[2]))
    assert reason == "length" and message.content is None and message.tool_calls is not None
    assert message.tool_calls[0].function.arguments == '{"zone":"U'
    message, reason = oa.chat_answer("job1", '{"name":"get_time","arguments":{"zone":', "length", _reading("auto"))
    assert reason == "length" and message.tool_calls is None  # auto and required: a cut text is text


THOUGHTS = ["<think>which tool?</think>", "  <think></think>", "<think>cut", ""]


@pytest.mark.parametrize("choice", [None, *CHOICES], ids=["no-tools", "auto", "required", "named"])
def test_thinking_then_the_answer_add_up_to_the_answer_without_stream(choice: Any) -> None:
    """gateway/openai_stream_chat.py: a reasoning model's thinking (qwen3's convention) comes apart as
    reasoning_content, the rest is read as text or calls, each piece size giving the message without stream."""
    from gateway.openai_stream_chat import ChoiceText

    calls = _reading(choice) if choice is not None else None
    for thought, text, reason in itertools.product(THOUGHTS, TEXTS[:6], ("stop", "length")):
        whole = thought + text
        message, want_reason = oa.chat_answer("job1", whole, reason, calls, "qwen3")  # type: ignore[arg-type]
        want = message.model_dump(mode="json", exclude={"role"})
        want.setdefault("tool_calls", None)
        if want["content"] == "" and calls is not None:  # the role chunk of a tools answer carries no content
            want["content"] = None
        for pieces in _splits(whole):
            stream = ChoiceText("qwen3", calls, "job1")
            deltas = [d for piece in pieces if piece for d in stream.on_text(piece)]
            last, got_reason = stream.on_done(reason)  # type: ignore[arg-type]
            got = _accumulate(deltas + last)
            if calls is None and got["content"] is None:
                got["content"] = ""  # a text answer's role chunk opens its content with ""
            assert (got, got_reason) == (want, want_reason), (choice, whole, pieces, reason)
