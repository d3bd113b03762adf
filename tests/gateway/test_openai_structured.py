"""Structured output through the fleet with the real `openai` client: `response_format` json_schema and
json_object, `tools` with each `tool_choice`, the job API's `response_format`, and a schema that does not
compile refused with a 400 before any job is queued. A real gateway, Redis and worker (tiny random target,
n-gram speculation: the worker's default without a draft)."""

import json
from typing import Any

import httpx
import jsonschema_rs
import openai
import pytest

from shared.openai_compat import ChatMessage
from shared.response_format import ToolCall, ToolCallFunction
from shared.settings import ServiceSettings
from tests.gateway.test_openai_api import MODEL, client, secret, served  # noqa: F401 (fixtures)
from tests.helpers.engine_worker import EngineThread
from tests.helpers.gateway import ThreadedGateway

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Oslo", "Lima"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "rain": {"type": "boolean"},
    },
    "required": ["city", "days", "rain"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_forecast", "description": "The weather for a few days", "parameters": SCHEMA},
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {
                "type": "object",
                "properties": {"zone": {"enum": ["UTC", "CET"]}},
                "required": ["zone"],
                "additionalProperties": False,
            },
        },
    },
]
MESSAGES = [{"role": "user", "content": "What is the weather in Paris this week?"}]
GREEDY = {"model": MODEL, "temperature": 0, "max_tokens": 64}


def test_json_schema_answer_follows_the_schema(client: openai.OpenAI) -> None:  # noqa: F811
    fmt = {"type": "json_schema", "json_schema": {"name": "forecast", "schema": SCHEMA, "strict": True}}
    for params in (GREEDY, {"model": MODEL, "temperature": 1.0, "seed": 7, "max_tokens": 64}):
        chat = client.chat.completions.create(messages=MESSAGES, response_format=fmt, **params)  # type: ignore[arg-type]
        answer = chat.choices[0].message.content
        assert chat.choices[0].finish_reason == "stop" and answer is not None
        assert jsonschema_rs.validator_for(SCHEMA).is_valid(json.loads(answer)), answer


def test_json_object_answer_is_an_object(client: openai.OpenAI) -> None:  # noqa: F811
    chat = client.chat.completions.create(
        messages=MESSAGES, response_format={"type": "json_object"}, **{**GREEDY, "max_tokens": 24}
    )  # type: ignore[arg-type]
    assert (chat.choices[0].message.content or "").startswith("{")


def test_named_and_required_tool_calls(client: openai.OpenAI) -> None:  # noqa: F811
    named = client.chat.completions.create(
        messages=MESSAGES, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_forecast"}},
        **GREEDY,
    )  # type: ignore[arg-type]
    message = named.choices[0].message
    assert message.content is None and message.tool_calls is not None and len(message.tool_calls) == 1
    call = message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_forecast" and call.id.startswith("call_")
    assert jsonschema_rs.validator_for(SCHEMA).is_valid(json.loads(call.function.arguments))
    assert named.choices[0].finish_reason == "stop"  # as OpenAI answers a forced function

    required = client.chat.completions.create(messages=MESSAGES, tools=TOOLS, tool_choice="required", **GREEDY)  # type: ignore[arg-type]
    assert required.choices[0].finish_reason == "tool_calls"
    calls = required.choices[0].message.tool_calls
    assert calls is not None and calls[0].function.name in ("get_forecast", "get_time")
    params = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == calls[0].function.name)
    assert jsonschema_rs.validator_for(params).is_valid(json.loads(calls[0].function.arguments))


def _streamed_choices(chunks: Any) -> dict[int, dict[str, Any]]:
    """A stream's choices as a client accumulates them: content, calls by index, finish reason."""
    choices: dict[int, dict[str, Any]] = {}
    for chunk in chunks:
        for c in chunk.choices:
            got = choices.setdefault(c.index, {"content": None, "tool_calls": {}, "finish_reason": None})
            if c.delta.content:
                got["content"] = (got["content"] or "") + c.delta.content
            for piece in c.delta.tool_calls or []:
                call = got["tool_calls"].setdefault(piece.index, {"id": None, "name": None, "arguments": ""})
                call["id"] = piece.id or call["id"]
                call["name"] = (piece.function.name if piece.function else None) or call["name"]
                call["arguments"] += (piece.function.arguments if piece.function else None) or ""
            got["finish_reason"] = c.finish_reason or got["finish_reason"]
    return choices


def test_a_streamed_call_adds_up_to_the_call_without_stream(client: openai.OpenAI) -> None:  # noqa: F811
    """`tools` with `stream: true` (OpenAI's and vLLM's agents stream them): each choice's chunks add up to the
    answer without stream, a named function's arguments arriving over several chunks."""
    named = {"type": "function", "function": {"name": "get_forecast"}}
    for tool_choice in (named, "required"):
        whole = client.chat.completions.create(messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice, **GREEDY)  # type: ignore[arg-type]
        chunks = list(client.chat.completions.create(
            messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice, stream=True, n=2, **GREEDY
        ))  # type: ignore[arg-type]
        streamed = _streamed_choices(chunks)
        assert sorted(streamed) == [0, 1]
        ids = set()
        for got in streamed.values():
            want = whole.choices[0]
            assert got["content"] is None and got["finish_reason"] == want.finish_reason
            assert want.message.tool_calls is not None and len(got["tool_calls"]) == len(want.message.tool_calls)
            call = got["tool_calls"][0]
            assert (call["name"], call["arguments"]) == (
                want.message.tool_calls[0].function.name, want.message.tool_calls[0].function.arguments
            )
            ids.add(call["id"])
        assert len(ids) == 2 and all(i.startswith("call_") for i in ids)  # a choice's job names its call
        if tool_choice is named:
            pieces = [c for c in chunks if c.choices and c.choices[0].delta.tool_calls and c.choices[0].index == 0]
            assert len(pieces) > 1  # the arguments streamed, not held
    text = list(client.chat.completions.create(
        messages=MESSAGES, tools=TOOLS, tool_choice="auto", stream=True, **{**GREEDY, "max_tokens": 8}
    ))  # type: ignore[arg-type]
    alone = client.chat.completions.create(messages=MESSAGES, tools=TOOLS, tool_choice="auto", **{**GREEDY, "max_tokens": 8})  # type: ignore[arg-type]
    got = _streamed_choices(text)[0]
    assert got["tool_calls"] == {} and (got["content"] or "") == alone.choices[0].message.content


def test_a_conversation_sends_the_call_and_its_result_back(client: openai.OpenAI) -> None:  # noqa: F811
    """The second turn of the tools workflow: the assistant's call (content null) and the tool's result go back
    in `messages`, and the model answers from them."""
    first = client.chat.completions.create(
        messages=MESSAGES, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_forecast"}},
        **GREEDY,
    )  # type: ignore[arg-type]
    call = first.choices[0].message.tool_calls[0]  # type: ignore[index]
    history = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"forecast": "rain"}'},
    ]
    second = client.chat.completions.create(messages=history, tools=TOOLS, tool_choice="none", **GREEDY)  # type: ignore[arg-type]
    assert second.choices[0].message.content is not None and second.choices[0].message.tool_calls is None
    alone = client.chat.completions.create(messages=MESSAGES, tools=TOOLS, tool_choice="none", **GREEDY)  # type: ignore[arg-type]
    assert second.usage.prompt_tokens > alone.usage.prompt_tokens  # type: ignore[union-attr]  # the turns reached it
    for bad, reason in (
        ({"role": "tool", "content": "x"}, "tool_call_id"),  # a result that names no call
        ({"role": "user", "content": "x", "tool_call_id": "c"}, "tool_call_id"),
        ({"role": "user", "content": None}, "content"),
    ):
        with pytest.raises(openai.BadRequestError, match=reason):
            client.chat.completions.create(messages=[*MESSAGES, bad], **GREEDY)  # type: ignore[arg-type,list-item]


def test_tool_messages_reach_the_engine_as_the_model_answers_calls() -> None:
    calls = [ToolCall(id="call_1", function=ToolCallFunction(name="get_forecast", arguments='{"city":"Oslo"}'))]
    assistant = ChatMessage(role="assistant", content=None, tool_calls=calls).to_message()
    assert assistant.role == "assistant" and assistant.content == '{"name":"get_forecast","arguments":{"city":"Oslo"}}'
    result = ChatMessage(role="tool", tool_call_id="call_1", content="rain").to_message()
    assert result.role == "user" and result.content == "Result of call call_1: rain"


def test_tool_choice_none_and_auto_leave_text(client: openai.OpenAI) -> None:  # noqa: F811
    for choice in ("none", "auto"):
        chat = client.chat.completions.create(
            messages=MESSAGES, tools=TOOLS, tool_choice=choice, **{**GREEDY, "max_tokens": 8}
        )  # type: ignore[arg-type]
        # a random model answers text, not a call: content stays text (auto reads a call back only when it is one)
        assert chat.choices[0].message.tool_calls is None and chat.choices[0].message.content is not None


def test_bad_schemas_and_tools_are_400_before_a_job(client: openai.OpenAI, served: ThreadedGateway) -> None:  # noqa: F811
    bad_bodies = [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objec"}}}},
         "objec"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/nope"}}}},
         "nope"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "missing"}}}, "missing"),
        ({"tool_choice": "required"}, "tool_choice needs tools"),
        ({"tools": TOOLS, "tool_choice": "required", "stream": True, "logprobs": True}, "logprobs"),
    ]
    for extra, named in bad_bodies:
        response = httpx.post(
            f"{served.url}/v1/chat/completions",
            json={"messages": MESSAGES, **GREEDY, **extra},
            headers={"Authorization": f"Bearer {client.api_key}"},
        )
        assert response.status_code == 400, (extra, response.text)
        assert named in response.json()["error"]["message"], response.json()
        assert "x-specfleet-job-id" not in response.headers  # refused before the queue
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(
            messages=MESSAGES,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 3}}},
            **GREEDY,
        )  # type: ignore[arg-type]
    assert bad.value.body["param"] == "response_format"  # type: ignore[index]


def test_job_api_takes_response_format(client: openai.OpenAI, served: ThreadedGateway) -> None:  # noqa: F811
    headers = {"Authorization": f"Bearer {client.api_key}", "Prefer": "wait=60"}
    body = {
        "prompt": "weather:",
        "max_tokens": 64,
        "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "forecast", "schema": SCHEMA}},
    }
    job = httpx.post(f"{served.url}/v1/jobs", json=body, headers=headers, timeout=90).json()
    assert job["status"] == "succeeded", job
    assert jsonschema_rs.validator_for(SCHEMA).is_valid(json.loads(job["output"]["text"]))
    bad = httpx.post(
        f"{served.url}/v1/jobs",
        json={**body, "response_format": {"type": "json_schema", "json_schema": {"name": "f", "schema": {"type": "objec"}}}},
        headers=headers,
    )
    assert bad.status_code == 422 and "objec" in bad.json()["error"]["message"]


def test_vllm_structured_outputs_and_guided_fields(client: openai.OpenAI, served: ThreadedGateway) -> None:  # noqa: F811
    """vLLM's `structured_outputs` (regex, choice, Lark grammar, JSON) and its older `guided_*` fields, through the
    fleet: the answers follow them; a regex that does not compile, two at once, or one with a constraining
    response_format is a 400 naming the problem before any job; /v1/jobs takes `structured_outputs`."""
    import re

    choices = ["positive", "negative", "neutral"]
    chat = client.chat.completions.create(messages=MESSAGES, extra_body={"guided_choice": choices}, **GREEDY)  # type: ignore[arg-type]
    assert chat.choices[0].message.content in choices and chat.choices[0].finish_reason == "stop"
    for extra, pattern in (
        ({"structured_outputs": {"regex": r"[0-9]{2}:[0-9]{2}"}}, r"[0-9]{2}:[0-9]{2}"),
        ({"guided_regex": r"(ab){1,3}c"}, r"(ab){1,3}c"),  # bounded: a random model would loop on `ab`
        ({"structured_outputs": {"grammar": 'start: item ("," item)?\nitem: "x" | "yz"'}}, r"(x|yz)(,(x|yz))?"),
    ):
        text = client.completions.create(prompt="time:", extra_body=extra, **GREEDY).choices[0].text  # type: ignore[arg-type]
        assert re.fullmatch(pattern, text), (extra, text)
    answer = client.completions.create(prompt="weather:", extra_body={"guided_json": SCHEMA}, **GREEDY).choices[0].text  # type: ignore[arg-type]
    assert jsonschema_rs.validator_for(SCHEMA).is_valid(json.loads(answer)), answer
    headers = {"Authorization": f"Bearer {client.api_key}"}
    for bad, reason in (
        ({"guided_regex": "["}, "invalid regex"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "give one of"),
        ({"structured_outputs": {"choice": []}}, "choice"),
        ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}}, "give one of"),
    ):
        response = httpx.post(f"{served.url}/v1/chat/completions", json={"messages": MESSAGES, **GREEDY, **bad}, headers=headers)
        assert response.status_code == 400 and reason in response.json()["error"]["message"], (bad, response.text)
        assert "x-specfleet-job-id" not in response.headers
    job = httpx.post(
        f"{served.url}/v1/jobs",
        json={"prompt": "mood:", "max_tokens": 16, "temperature": 0, "structured_outputs": {"choice": choices}},
        headers={**headers, "Prefer": "wait=60"},
        timeout=90,
    ).json()
    assert job["status"] == "succeeded" and job["output"]["text"] in choices, job


def test_a_reasoning_models_thinking_comes_apart(
    engine_thread: EngineThread, settings: ServiceSettings, secret: str  # noqa: F811
) -> None:
    """settings.reasoning_parser `qwen3`: a chat answer's `<think>...</think>` is `reasoning_content`, the rest
    `content` (read as a function call under tools), streamed or not (the answers forced by a choice: the tiny
    model does not think); an answer without it has no `reasoning_content`."""
    thought = '<think>the user wants Paris</think>{"name":"get_time","arguments":{"zone":"UTC"}}'
    thinking = settings.model_copy(update={"reasoning_parser": "qwen3"})
    with ThreadedGateway(thinking, default_key=False).start() as server:
        with openai.OpenAI(base_url=f"{server.url}/v1", api_key=secret, max_retries=0, timeout=60) as oai:
            forced = {"guided_choice": ["<think>rain, mostly</think>It will rain."]}
            whole = oai.chat.completions.create(messages=MESSAGES, extra_body=forced, **GREEDY).choices[0].message  # type: ignore[arg-type]
            assert (whole.model_extra or {}).get("reasoning_content") == "rain, mostly"
            assert whole.content == "It will rain."
            chunks = list(oai.chat.completions.create(messages=MESSAGES, extra_body=forced, stream=True, **GREEDY))  # type: ignore[arg-type]
            deltas = [c.choices[0].delta for c in chunks if c.choices]
            assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas) == "rain, mostly"
            assert "".join(d.content or "" for d in deltas) == "It will rain."
            call = oai.chat.completions.create(
                messages=MESSAGES, tools=TOOLS, extra_body={"guided_choice": [thought]}, **GREEDY
            ).choices[0]  # type: ignore[arg-type]
            assert call.finish_reason == "tool_calls" and call.message.tool_calls is not None
            assert call.message.tool_calls[0].function.name == "get_time"
            assert (call.message.model_extra or {}).get("reasoning_content") == "the user wants Paris"
            plain = oai.chat.completions.create(messages=MESSAGES, extra_body={"guided_choice": ["no thinking"]}, **GREEDY)  # type: ignore[arg-type]
            assert plain.choices[0].message.content == "no thinking"
            assert "reasoning_content" not in plain.choices[0].message.model_dump(exclude_unset=True)
