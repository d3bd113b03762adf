"""A response's events (gateway/openai_responses_stream.py): whatever the answer's text, its thinking and its tool
choice, and however its tokens split it, the items the events open and close are the items of the stored response
(shared/openai_response_object.response_of), their deltas add up to their texts, and the sequence numbers count
from 0 without a gap."""

import json
from typing import Any

import pytest

from gateway.openai_responses_stream import ResponseEvents
from gateway.openai_stream_chat import ChoiceText
from shared import openai_compat as oa
from shared import openai_response_object as ro
from shared.job_state import JobStatus
from shared.openai_responses import ResponseRequest
from shared.schemas import Job, JobOutput, JobUrls, Priority, Usage
from tests.gateway.test_openai_stream_tools import TEXTS, _splits

TOOLS = [
    {"type": "function", "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}}},
    {"type": "function", "name": "get_date"},
]
CHOICES: list[Any] = [None, "auto", "required", {"type": "function", "name": "get_time"}]


def _job(text: str, reason: str) -> Job:
    output = JobOutput(text=text, finish_reason=reason)
    urls = JobUrls(get="http://x/v1/jobs/job1", cancel="http://x/v1/jobs/job1/cancel", stream="http://x/v1/jobs/job1/stream")
    return Job(id="job1", status=JobStatus.SUCCEEDED, priority=Priority.DEFAULT, created_at=1.0, completed_at=2.0,
               output=output, usage=Usage(prompt_tokens=3, completion_tokens=4), urls=urls)  # fmt: skip


def _events(frames: list[bytes]) -> list[dict[str, Any]]:
    events = []
    for frame in frames:
        kind, data = frame.decode().removesuffix("\n\n").split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert kind == f"event: {event['type']}"
        events.append(event)
    return events


def _streamed(body: ResponseRequest, pieces: list[str], reason: str, parser: Any) -> tuple[list[dict[str, Any]], ro.Response]:
    job = _job("".join(pieces), reason)
    stored = ro.response_of(job, body, "m", parser)
    events = ResponseEvents(job.id)
    text = ChoiceText(parser, body.chat_request([]).call_reading(), job.id)
    queued = ro.response_of(job.model_copy(update={"status": JobStatus.QUEUED, "output": None}), body, "m", parser)
    frames = events.opening(queued)
    for piece in pieces:
        for delta in text.on_text(piece) if piece else []:
            frames += events.on_delta(delta)
    for delta in text.on_done(oa.finish_reason(reason))[0]:
        frames += events.on_delta(delta)
    return _events(frames + events.closing(stored)), stored


def _check(events: list[dict[str, Any]], stored: ro.Response) -> None:
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[-1]["type"] == {"completed": "response.completed", "incomplete": "response.incomplete"}[stored.status]
    assert events[-1]["response"] == stored.model_dump(mode="json")
    done = [e for e in events if e["type"] == "response.output_item.done"]
    added = [e for e in events if e["type"] == "response.output_item.added"]
    assert [e["item"] for e in done] == [item.model_dump(mode="json") for item in stored.output]
    assert [e["output_index"] for e in added] == [e["output_index"] for e in done] == list(range(len(stored.output)))
    for item in stored.output:
        deltas = "".join(e["delta"] for e in events if e.get("item_id") == item.id and e["type"].endswith(".delta"))
        if isinstance(item, ro.OutputMessage):
            assert deltas == item.content[0].text
        elif isinstance(item, ro.OutputFunctionCall):
            assert deltas == item.arguments
        else:
            assert deltas == item.content[0].text


@pytest.mark.parametrize("choice", CHOICES, ids=["no-tools", "auto", "required", "named"])
@pytest.mark.parametrize("reason", ["stop", "length"])
def test_the_events_add_up_to_the_stored_response(choice: Any, reason: str) -> None:
    fields: dict[str, Any] = {"input": "hi"}
    if choice is not None:
        fields |= {"tools": TOOLS, "tool_choice": choice}
    body = ResponseRequest.model_validate(fields)
    for text in TEXTS:
        for pieces in _splits(text):
            events, stored = _streamed(body, pieces, reason, "none")
            _check(events, stored)


@pytest.mark.parametrize("reason", ["stop", "length"])
def test_a_thought_is_its_own_item_before_the_answer(reason: str) -> None:
    body = ResponseRequest.model_validate({"input": "hi", "tools": TOOLS})
    for text in ["<think>the user wants noon</think>It is noon.", '<think>call it</think>{"name":"get_date","arguments":{}}',
                 "<think>cut while thinking", "no thought"]:  # fmt: skip
        for pieces in _splits(text):
            events, stored = _streamed(body, pieces, reason, "qwen3")
            _check(events, stored)
            kinds = [item.type for item in stored.output]
            assert kinds[0] == "reasoning" if "<think>" in text else "reasoning" not in kinds
    cut = ro.response_of(_job("<think>cut while thinking", "length"), body, "m", "qwen3")
    assert [(item.type, item.status) for item in cut.output] == [("reasoning", "incomplete"), ("message", "incomplete")]
