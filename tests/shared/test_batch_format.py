"""Batch input validation (every bad line named) and the OpenAI request/response translation."""

import json

import pytest

from shared.batch_format import BatchLine, BatchTooLarge, parse_batch, result_line
from shared.batch_state import TRANSITIONS, BatchStatus, can_transition
from shared.job_record import job_urls
from shared.job_state import JobStatus
from shared.schemas import ErrorInfo, Job, JobOutput, Priority, Usage


def line(custom_id: str, url: str = "/v1/completions", **body: object) -> str:
    return json.dumps(
        {"custom_id": custom_id, "method": "POST", "url": url, "body": body or {"prompt": "hi"}}
    )


def test_valid_lines_of_every_url() -> None:
    data = "\n".join(
        [
            line("a", prompt="def f(", max_tokens=5, stop="\n", temperature=0),
            line(
                "b", "/v1/chat/completions", messages=[{"role": "user", "content": "hi"}], model="m", seed=3
            ),
            line("c", "/v1/jobs", prompt="x", max_tokens=2, metadata={"k": "v"}),
            "",
        ]
    ).encode()
    lines, errors = parse_batch(data, 10)
    assert errors == []
    a, b, c = lines
    assert a.request.prompt == "def f(" and a.request.stop == ["\n"] and a.request.temperature == 0
    assert (
        b.request.messages is not None
        and b.request.max_tokens == 256
        and b.model == "m"
        and b.request.seed == 3
    )
    assert c.request.metadata == {"k": "v"}
    assert all(x.request.priority is Priority.BATCH for x in lines)
    assert BatchLine.from_json(a.to_json()) == a
    assert parse_batch(line("d").encode(), 10)[0][0].request.max_tokens == 16  # OpenAI's completions default


def test_every_bad_line_is_reported() -> None:
    data = "\n".join(
        [
            line("ok"),
            "{not json",
            json.dumps({"custom_id": "x", "method": "GET", "url": "/v1/completions", "body": {}}),
            line("y", "/v1/embeddings"),
            line("z", "/v1/completions", prompt="p", n=2),
            line("ok"),
            line("w", "/v1/jobs", prompt="p", webhook="https://example.com/"),
            json.dumps([1]),
            line("v", "/v1/chat/completions", messages=[]),
            line("u", "/v1/completions", prompt=""),
            line("t", "/v1/jobs", prompt=""),
            line("s", "/v1/completions", prompt=["a", "b"]),  # several prompts: several jobs, not a line's one
        ]
    ).encode()
    lines, errors = parse_batch(data, 100)
    assert [(e.line, e.code) for e in errors] == [
        (2, "invalid_json"),
        (3, "invalid_method"),
        (4, "invalid_url"),
        (5, "invalid_body"),
        (6, "duplicate_custom_id"),
        (7, "invalid_body"),
        (8, "invalid_line"),
        (9, "invalid_body"),
        (10, "invalid_body"),
        (11, "invalid_body"),
        (12, "invalid_body"),
    ]
    assert "body.n" in errors[3].message and "line 1" in errors[4].message
    assert errors[-1].message.startswith("body.prompt: one prompt a line")


def test_a_line_naming_a_model_the_fleet_does_not_serve_is_bad() -> None:
    """It ran on the served model, and its result said `"model": "gpt-4"`; the OpenAI routes answer it 404."""
    data = "\n".join([line("a", prompt="p", model="gpt-4"), line("b", prompt="p", model="demo"), line("c"),
                      line("d", "/v1/jobs", prompt="p")])
    lines, errors = parse_batch(data.encode(), 100, served_model="demo")
    assert [(e.line, e.code) for e in errors] == [(1, "model_not_found")]
    assert errors[0].message == "the model `gpt-4` does not exist; this fleet serves `demo`"
    assert [x.custom_id for x in lines] == ["b", "c", "d"]
    assert not parse_batch(data.encode(), 100)[1]  # no worker has said what it serves yet: any model


def test_limits_and_empty_file() -> None:
    with pytest.raises(BatchTooLarge):
        parse_batch("\n".join(line(str(i)) for i in range(4)).encode(), 3)
    assert parse_batch(b"\n \n", 3)[1][0].code == "empty_file"


def _job(status: JobStatus, **extra: object) -> Job:
    return Job(
        id="j1",
        status=status,
        priority=Priority.BATCH,
        created_at=1.0,
        urls=job_urls("http://x", "j1"),
        **extra,
    )


def test_result_lines_in_openai_shapes() -> None:
    lines, _ = parse_batch(
        (
            line("a", prompt="hi", max_tokens=3)
            + "\n"
            + line("b", "/v1/chat/completions", messages=[{"role": "user", "content": "q"}])
        ).encode(),
        5,
    )
    done = _job(
        JobStatus.SUCCEEDED,
        output=JobOutput(text="abc", token_ids=[1, 2, 3], finish_reason="length"),
        usage=Usage(prompt_tokens=2, completion_tokens=3),
    )
    completion = result_line(lines[0], done, "tiny")
    assert completion["custom_id"] == "a" and completion["error"] is None
    body = completion["response"]["body"]
    assert completion["response"]["status_code"] == 200
    assert body["object"] == "text_completion" and body["choices"][0]["text"] == "abc"
    assert body["choices"][0]["finish_reason"] == "length" and body["usage"]["total_tokens"] == 5
    chat = result_line(lines[1], done, "tiny")["response"]["body"]
    assert chat["object"] == "chat.completion" and chat["choices"][0]["message"] == {
        "role": "assistant",
        "content": "abc",
    }
    failed = result_line(
        lines[0], _job(JobStatus.FAILED, error=ErrorInfo(code="engine_error", message="boom")), "m"
    )
    assert failed["response"] is None and failed["error"] == {"code": "engine_error", "message": "boom"}


def test_a_chat_line_with_tools_answers_its_calls_as_the_route_does() -> None:
    """A line's tool choice is kept with it (stored, read back) so that its result line reads the answer as
    function calls, as POST /v1/chat/completions answers the same body (it was the text)."""
    params = {"type": "object", "properties": {"zone": {"enum": ["UTC"]}}, "required": ["zone"]}
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": params}}]
    messages = [{"role": "user", "content": "time?"}]
    named = {"type": "function", "function": {"name": "get_time"}}
    text = (
        line("named", "/v1/chat/completions", messages=messages, tools=tools, tool_choice=named)
        + "\n" + line("auto", "/v1/chat/completions", messages=messages, tools=tools)
        + "\n" + line("none", "/v1/chat/completions", messages=messages, tools=tools, tool_choice="none")
    )
    lines, errors = parse_batch(text.encode(), 5)
    assert not errors
    stored = [BatchLine.from_json(one.to_json()) for one in lines]  # as the finalize task reads them
    assert stored[2].calls is None and "calls" not in json.loads(lines[2].to_json())
    call = _job(JobStatus.SUCCEEDED, output=JobOutput(text='{"name":"get_time","arguments":{"zone":"UTC"}}',
                                                       token_ids=[1], finish_reason="stop"))
    arguments = _job(JobStatus.SUCCEEDED, output=JobOutput(text='{"zone":"UTC"}', token_ids=[1], finish_reason="stop"))
    named_body = result_line(stored[0], arguments, "tiny")["response"]["body"]["choices"][0]
    assert named_body["finish_reason"] == "stop" and named_body["message"]["content"] is None
    assert named_body["message"]["tool_calls"] == [
        {"id": "call_j1_0", "type": "function", "function": {"name": "get_time", "arguments": '{"zone":"UTC"}'}}
    ]
    auto_body = result_line(stored[1], call, "tiny")["response"]["body"]["choices"][0]
    assert auto_body["finish_reason"] == "tool_calls"
    assert auto_body["message"]["tool_calls"][0]["function"] == {"name": "get_time", "arguments": '{"zone": "UTC"}'}
    none_body = result_line(stored[2], call, "tiny")["response"]["body"]["choices"][0]
    assert none_body["message"] == {"role": "assistant", "content": call.output.text}  # type: ignore[union-attr]


def test_batch_transitions() -> None:
    assert can_transition(BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS)
    assert can_transition(BatchStatus.IN_PROGRESS, BatchStatus.CANCELLING)
    assert not can_transition(BatchStatus.FINALIZING, BatchStatus.CANCELLING)
    assert {s for s in BatchStatus if s.is_terminal} == {
        BatchStatus.COMPLETED,
        BatchStatus.FAILED,
        BatchStatus.EXPIRED,
        BatchStatus.CANCELLED,
    }
    assert all(status in TRANSITIONS for status in BatchStatus)
    assert BatchStatus.IN_PROGRESS.timestamp_field == "in_progress_at"


def test_a_chat_lines_thinking_comes_apart_as_on_the_route() -> None:
    """settings.reasoning_parser reaches batch result lines: `reasoning_content` apart from `content`."""
    lines, _ = parse_batch(line("c", "/v1/chat/completions", messages=[{"role": "user", "content": "q"}]).encode(), 5)
    done = _job(JobStatus.SUCCEEDED, output=JobOutput(text="<think>hm</think>yes", token_ids=[1], finish_reason="stop"))
    message = result_line(lines[0], done, "tiny", "qwen3")["response"]["body"]["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "yes", "reasoning_content": "hm"}
    assert result_line(lines[0], done, "tiny")["response"]["body"]["choices"][0]["message"]["content"] == (
        "<think>hm</think>yes"  # the default: no parser, the text as it came
    )


def test_a_responses_line_is_its_conversation_and_answers_a_response() -> None:
    """/v1/responses lines (OpenAI's Batch API takes them): the job is the route's conversation (instructions,
    then the input), the result body the route's `response` object (output items, usage, the request's fields),
    not stored for GET; what a line cannot be (a stream, a background run, a previous response's next turn) is a
    bad line naming the field."""
    tools = [{"type": "function", "name": "get_time", "parameters": {"type": "object", "properties": {}}}]
    text = "\n".join([
        line("r", "/v1/responses", input="time?", instructions="Be brief.", max_output_tokens=7, metadata={"k": "v"}),
        line("t", "/v1/responses", input=[{"role": "user", "content": "time?"}], tools=tools,
             tool_choice={"type": "function", "name": "get_time"}),
        line("s", "/v1/responses", input="x", stream=True),
        line("b", "/v1/responses", input="x", background=True),
        line("p", "/v1/responses", input="x", previous_response_id="resp_abc"),
        line("i", "/v1/responses", input=[{"type": "web_search_call"}]),
    ])  # fmt: skip
    lines, errors = parse_batch(text.encode(), 10)
    assert [(e.line, e.code) for e in errors] == [(n, "invalid_body") for n in (3, 4, 5, 6)]
    assert [e.message.split(":")[0] for e in errors[:3]] == ["stream", "background", "previous_response_id"]
    r, t = [BatchLine.from_json(one.to_json()) for one in lines]  # as the finalize task reads them
    assert r.request is not None and r.request.priority is Priority.BATCH and r.request.max_tokens == 7
    assert [(m.role, m.content) for m in r.request.messages or []] == [("system", "Be brief."), ("user", "time?")]
    done = _job(JobStatus.SUCCEEDED, output=JobOutput(text="noon", token_ids=[1], finish_reason="stop"),
                usage=Usage(prompt_tokens=5, completion_tokens=1))  # fmt: skip
    body = result_line(r, done, "tiny")["response"]["body"]
    assert body["object"] == "response" and body["id"] == "resp_j1" and body["status"] == "completed"
    assert body["output"][0]["content"][0]["text"] == "noon" and body["usage"]["total_tokens"] == 6
    assert body["instructions"] == "Be brief." and body["metadata"] == {"k": "v"} and body["store"] is False
    call = result_line(t, done.model_copy(update={"output": JobOutput(text="{}", token_ids=[1], finish_reason="stop")}), "tiny")
    assert [(i["type"], i["name"], i["arguments"]) for i in call["response"]["body"]["output"]] == [("function_call", "get_time", "{}")]
