"""OpenAI's Responses API through the fleet with the real `openai` client (its `responses` resource and stream
helper): a response is a job, read back whole, streamed, chained by `previous_response_id`, run in the background,
cancelled, deleted; tools, formats, logprobs and a reasoning model's thoughts as output items; what it cannot do
is a 400 naming the field, before any job. A real gateway (uvicorn), Redis and worker (tiny random model pair)."""

import json
from typing import Any, Literal

import httpx
import openai
import pydantic
import pytest
import redis

from shared import keys
from shared.settings import ServiceSettings
from tests.gateway.test_openai_api import MODEL, client, secret, served  # noqa: F401 (fixtures)
from tests.helpers.engine_worker import EngineThread
from tests.helpers.gateway import ThreadedGateway
from tests.helpers.redis_fixtures import create_key

GREEDY: dict[str, Any] = {"model": MODEL, "temperature": 0, "max_output_tokens": 12}
ZONE = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"], "additionalProperties": False}
NOTHING = {"type": "object", "properties": {}, "additionalProperties": False}
TOOLS: Any = [{"type": "function", "name": "get_time", "parameters": ZONE},
              {"type": "function", "name": "get_date", "parameters": NOTHING}]  # fmt: skip


class Zone(pydantic.BaseModel):
    zone: Literal["UTC", "CET"]


def _job(server: ThreadedGateway, key: str, job_id: str) -> dict[str, Any]:
    answer = httpx.get(f"{server.url}/v1/jobs/{job_id}", headers={"Authorization": f"Bearer {key}"})
    assert answer.status_code == 200
    return answer.json()  # type: ignore[no-any-return]


def test_a_response_is_a_job_read_back_whole(client: openai.OpenAI, served: ThreadedGateway, secret: str) -> None:  # noqa: F811
    raw = client.responses.with_raw_response.create(
        input="def f(x):", instructions="Write Python.", metadata={"run": "1"}, extra_body={"ignore_eos": True}, **GREEDY
    )
    response = raw.parse()
    job = _job(served, secret, raw.headers["x-specfleet-job-id"])
    assert response.id == f"resp_{job['id']}" and response.object == "response" and response.model == MODEL
    assert response.status == "incomplete" and response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.output_text == job["output"]["text"] and response.output[0].type == "message"
    assert response.usage is not None and response.usage.output_tokens == 12
    assert response.usage.input_tokens == job["usage"]["prompt_tokens"] > 0
    assert response.instructions == "Write Python." and response.metadata == {"run": "1"}
    assert client.responses.retrieve(response.id).model_dump() == response.model_dump()
    items = client.responses.input_items.list(response.id).data
    assert [(i.type, i.role, i.content[0].text) for i in items] == [("message", "user", "def f(x):")]  # type: ignore[union-attr]
    plain = client.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=12, extra_body={"ignore_eos": True},
        messages=[{"role": "system", "content": "Write Python."}, {"role": "user", "content": "def f(x):"}],
    )  # fmt: skip
    assert plain.choices[0].message.content == response.output_text  # the same conversation: the same answer


def test_a_next_turn_reports_the_cached_part_of_its_input(client: openai.OpenAI) -> None:  # noqa: F811
    """A conversation's next turn repeats its first turn's prompt and answer: the worker's prefix cache holds
    them, and `usage.input_tokens_details.cached_tokens` says how many (the first turn's: 0)."""
    first = client.responses.create(input="def area(radius):\n    return 3.14159 * radius * radius\n" * 5, **GREEDY)
    second = client.responses.create(input="and the volume?", previous_response_id=first.id, **GREEDY)
    assert first.usage is not None and first.usage.input_tokens_details.cached_tokens == 0
    assert second.usage is not None
    assert 16 <= second.usage.input_tokens_details.cached_tokens < second.usage.input_tokens


def test_a_stream_adds_up_to_the_stored_response(client: openai.OpenAI) -> None:  # noqa: F811
    answers = ["It is noon in Paris.", "No idea."]
    extra = {"guided_choice": answers, "stream_options": {"include_obfuscation": False}}  # OpenAI's option: no padding
    with client.responses.stream(input="time?", extra_body=extra, **GREEDY | {"max_output_tokens": 32}) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:4]] == ["response.created", "response.in_progress", "response.output_item.added",
                                           "response.content_part.added"]  # fmt: skip
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == final.output_text in answers and final.status == "completed"
    stored = client.responses.retrieve(final.id)  # (the stream helper's items carry a `parsed` of its own)
    assert stored.model_dump(exclude={"output"}) == final.model_dump(exclude={"output"})
    assert [(i.id, i.status) for i in stored.output] == [(i.id, i.status) for i in final.output]  # type: ignore[union-attr]
    assert stored.output_text == final.output_text


def test_function_calls_and_their_outputs_go_on_the_conversation(client: openai.OpenAI) -> None:  # noqa: F811
    named = client.responses.create(input="What time is it?", tools=TOOLS, tool_choice={"type": "function", "name": "get_time"},
                                    **GREEDY | {"max_output_tokens": 32})  # fmt: skip
    call = named.output[0]
    assert call.type == "function_call" and call.name == "get_time" and json.loads(call.arguments)["zone"] in ("UTC", "CET")
    assert call.call_id == f"call_{named.id.removeprefix('resp_')}_0" and named.status == "completed"
    required = client.responses.create(input="What time is it?", tools=TOOLS, tool_choice="required", **GREEDY | {"max_output_tokens": 32})
    assert required.output[0].type == "function_call", required.output
    assert required.output[0].name in ("get_time", "get_date")
    # the result goes back by previous_response_id: the model reads the whole conversation
    result = {"type": "function_call_output", "call_id": call.call_id, "output": '{"time": "12:00"}'}
    second = client.responses.create(previous_response_id=named.id, input=[result], tools=TOOLS, tool_choice="none", **GREEDY)  # type: ignore[list-item]
    assert second.output[0].type == "message" and second.previous_response_id == named.id
    alone = client.responses.create(input=[result], tools=TOOLS, tool_choice="none", **GREEDY)  # type: ignore[list-item]
    assert second.usage is not None and alone.usage is not None and second.usage.input_tokens > alone.usage.input_tokens
    # ... or sent whole (the output items as the next input): the same prompt
    whole = client.responses.create(input=[{"role": "user", "content": "What time is it?"}, *named.output, result],  # type: ignore[list-item]
                                    tools=TOOLS, tool_choice="none", **GREEDY)  # fmt: skip
    assert whole.usage is not None and whole.usage.input_tokens == second.usage.input_tokens
    assert whole.output_text == second.output_text
    with client.responses.stream(input="What time is it?", tools=TOOLS, tool_choice={"type": "function", "name": "get_time"},
                                 **GREEDY | {"max_output_tokens": 32}) as stream:  # fmt: skip
        events = list(stream)
        streamed = stream.get_final_response()
    arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert arguments == streamed.output[0].arguments == call.arguments  # type: ignore[union-attr]


def test_text_format_and_logprobs(client: openai.OpenAI) -> None:  # noqa: F811
    schema = {"name": "time", "type": "json_schema", "schema": ZONE}
    shaped = client.responses.create(input="zone?", text={"format": schema}, **GREEDY | {"max_output_tokens": 32})  # type: ignore[arg-type]
    assert json.loads(shaped.output_text)["zone"] in ("UTC", "CET") and shaped.text.format.type == "json_schema"  # type: ignore[union-attr]
    parsed = client.responses.parse(input="zone?", text_format=Zone, **GREEDY | {"max_output_tokens": 32})  # the SDK's
    assert parsed.output_parsed is not None and parsed.output_parsed.zone in ("UTC", "CET")  # strict schema helper
    scored = client.responses.create(input="def f(x):", include=["message.output_text.logprobs"], top_logprobs=2,
                                     extra_body={"ignore_eos": True}, **GREEDY)  # fmt: skip
    logprobs = scored.output[0].content[0].logprobs  # type: ignore[union-attr]
    assert logprobs is not None and len(logprobs) == 12 and all(len(t.top_logprobs) == 2 for t in logprobs)
    assert all(t.logprob <= 0 and t.logprob >= t.top_logprobs[-1].logprob for t in logprobs)  # greedy: the top one
    # on a stream, each delta carries its tokens' logprobs: they add up to the stored message's
    with client.responses.stream(input="def f(x):", include=["message.output_text.logprobs"], top_logprobs=2,
                                 extra_body={"ignore_eos": True}, **GREEDY) as stream:  # fmt: skip
        events = list(stream)
    def scored(lp: Any) -> tuple[Any, ...]:
        return lp.token, lp.logprob, [(t.token, t.logprob) for t in lp.top_logprobs or []]

    streamed = [scored(lp) for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    stored = client.responses.retrieve(events[-1].response.id).output[0].content[0].logprobs  # type: ignore[union-attr]
    assert len(streamed) == 12 and streamed == [scored(lp) for lp in stored or []]
    done = next(e for e in events if e.type == "response.output_text.done")
    assert len(done.logprobs) == 12


def test_background_cancel_delete_and_other_keys(
    client: openai.OpenAI, served: ThreadedGateway, settings: ServiceSettings  # noqa: F811
) -> None:
    running = client.responses.create(input="def f(x):", background=True, extra_body={"ignore_eos": True},
                                      **GREEDY | {"max_output_tokens": 400})  # fmt: skip
    assert running.status in ("queued", "in_progress") and running.background and running.output == []
    cancelled = client.responses.cancel(running.id)
    assert cancelled.status == "cancelled" and client.responses.retrieve(running.id).status == "cancelled"
    done = client.responses.create(input="hi", **GREEDY)
    with pytest.raises(openai.BadRequestError, match="background"):
        client.responses.cancel(done.id)
    assert settings.redis_url is not None
    other = create_key(settings.redis_url, "other", requests_per_min=100, tokens_per_min=10**6)[1]
    with openai.OpenAI(base_url=f"{served.url}/v1", api_key=other, max_retries=0, timeout=60) as stranger:
        reads = (stranger.responses.retrieve, stranger.responses.delete, stranger.responses.cancel,
                 stranger.responses.input_items.list)  # fmt: skip
        for read in reads:
            with pytest.raises(openai.NotFoundError):
                read(done.id)  # type: ignore[operator]
        with pytest.raises(openai.NotFoundError) as chained:
            stranger.responses.create(input="more", previous_response_id=done.id, **GREEDY)
        assert chained.value.body["param"] == "previous_response_id"  # type: ignore[index]
    client.responses.delete(done.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(done.id)
    unstored = client.responses.create(input="hi", store=False, **GREEDY)
    assert unstored.store is False and unstored.status in ("completed", "incomplete")
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_a_response_that_could_not_be_stored_cancels_its_job(
    served: ThreadedGateway, secret: str, monkeypatch: pytest.MonkeyPatch  # noqa: F811
) -> None:
    """Redis failing between the submit and the response's record (injected in the gateway's store): the call is
    a 503, and its job, which nobody could find as a response, is cancelled rather than left to run unanswered."""
    store = served.server.config.app.state.gateway.store

    async def fails(*args: object) -> None:
        raise redis.ConnectionError("injected: Redis went away after the submit")

    monkeypatch.setattr(store, "keep_response", fails)
    headers = {"Authorization": f"Bearer {secret}"}
    answer = httpx.post(f"{served.url}/v1/responses", headers=headers, timeout=60,
                        json={"input": "def f(x):", "background": True, "ignore_eos": True, **GREEDY,
                              "max_output_tokens": 400})  # fmt: skip
    assert answer.status_code == 503, answer.text
    (job,) = httpx.get(f"{served.url}/v1/jobs", headers=headers).json()["data"]  # this key's one job
    assert job["status"] == "cancelled", job


def test_a_background_response_streams_again_from_any_event(client: openai.OpenAI) -> None:  # noqa: F811
    """GET /v1/responses/{id}?stream=true: the response's events from the first (its job's are kept), or after
    `starting_after`, as OpenAI resumes a background stream; the last one is the stored response."""
    started = client.responses.create(input="def f(x):", background=True, extra_body={"ignore_eos": True}, **GREEDY)
    whole = list(client.responses.retrieve(started.id, stream=True))  # follows the job to its end
    assert [e.sequence_number for e in whole] == list(range(len(whole))) and whole[-1].type == "response.incomplete"
    stored = client.responses.retrieve(started.id)
    assert whole[-1].response.model_dump() == stored.model_dump()  # type: ignore[union-attr]
    text = "".join(e.delta for e in whole if e.type == "response.output_text.delta")
    assert text == stored.output_text and len(text) > 0
    again = list(client.responses.retrieve(started.id, stream=True))
    assert [e.model_dump() for e in again] == [e.model_dump() for e in whole]
    assert whole[0].response.status == "in_progress" and whole[0].response.output == []  # type: ignore[union-attr]
    resumed = list(client.responses.retrieve(started.id, stream=True, starting_after=4))
    assert [e.model_dump() for e in resumed] == [e.model_dump() for e in whole[5:]]
    with pytest.raises(openai.BadRequestError, match="starting_after"):
        client.responses.retrieve(started.id, starting_after=4)


def test_a_stored_record_that_no_longer_validates_still_reads(client: openai.OpenAI, settings: ServiceSettings) -> None:  # noqa: F811
    """A record stored by another version (or changed in Redis): GET answers its output without the options that
    no longer validate, and going on from it is a 400 naming previous_response_id, never a 500."""
    first = client.responses.create(input="hi", **GREEDY)
    assert settings.redis_url is not None
    job_hash = keys.job_hash(first.id.removeprefix("resp_"))
    with redis.Redis.from_url(settings.redis_url) as rclient:
        record = json.loads(rclient.hget(job_hash, keys.RESPONSE_FIELD))  # type: ignore[arg-type]
        record["request"]["temperature"] = 99.0  # past today's bound
        record["input"][0]["type"] = "an_item_of_tomorrow"
        rclient.hset(job_hash, keys.RESPONSE_FIELD, json.dumps(record))
    read = client.responses.retrieve(first.id)
    assert read.output_text == first.output_text and read.temperature == 1.0  # its options fell back to defaults
    with pytest.raises(openai.BadRequestError) as chained:
        client.responses.create(input="more", previous_response_id=first.id, **GREEDY)
    assert chained.value.body["param"] == "previous_response_id"  # type: ignore[index]


def test_a_reasoning_models_thought_is_an_item(engine_thread: EngineThread, settings: ServiceSettings, secret: str) -> None:  # noqa: F811
    thinking = settings.model_copy(update={"reasoning_parser": "qwen3"})
    forced = {"guided_choice": ["<think>noon in Paris</think>It is noon."]}
    with ThreadedGateway(thinking, default_key=False).start() as server:
        with openai.OpenAI(base_url=f"{server.url}/v1", api_key=secret, max_retries=0, timeout=60) as oai:
            first = oai.responses.create(input="time?", extra_body=forced, **GREEDY | {"max_output_tokens": 32})
            assert [item.type for item in first.output] == ["reasoning", "message"]
            assert first.output[0].content[0].text == "noon in Paris" and first.output_text == "It is noon."  # type: ignore[union-attr,index]
            with oai.responses.stream(input="time?", extra_body=forced, **GREEDY | {"max_output_tokens": 32}) as stream:
                events = list(stream)
            assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == "noon in Paris"
            # the thought's logprobs ride the answer's first text: the deltas' add up to the message's, a token each
            scored = {"include": ["message.output_text.logprobs"], **GREEDY, "max_output_tokens": 32}
            with oai.responses.stream(input="time?", extra_body=forced, **scored) as stream:  # type: ignore[arg-type]
                events = list(stream)
            streamed = [lp.token for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
            stored = oai.responses.retrieve(events[-1].response.id)  # type: ignore[union-attr]
            assert streamed == [lp.token for lp in stored.output[1].content[0].logprobs or []]  # type: ignore[union-attr]
            assert stored.usage is not None and len(streamed) == stored.usage.output_tokens
            # the next turn reads the answer, not the thought
            oai.responses.create(previous_response_id=first.id, input="and now?", **GREEDY)


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({"tools": [{"type": "web_search"}]}, "tools"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]}, "input_image"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "item_reference"),
        ({"input": [{"type": {}}]}, "input[0]"),  # a type that is no name (schemathesis: it was a 500)
        ({"n": 2}, "n"),
        ({"max_tokens": 5}, "max_output_tokens"),
        ({"reasoning": {"effort": "high"}}, "reasoning"),
        ({"truncation": "auto"}, "truncation"),
        ({"background": True, "store": False}, "store"),
        ({"include": ["reasoning.encrypted_content"]}, "include"),
        ({"stream": True, "include": ["message.output_text.logprobs"], "tools": TOOLS}, "tools"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "missing"}}, "missing"),
        ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "objec"}}}}, "objec"),
        ({"text": {"format": {"type": "json_schema"}}}, "name"),
        ({"input": []}, "input"),
        ({"previous_response_id": "resp_nothing"}, "previous_response_id"),
        ({"max_output_tokens": 10**6}, "max_output_tokens: at most"),  # the served model's limit, by its name
    ],
)
def test_what_cannot_be_done_is_refused_before_a_job(
    client: openai.OpenAI, served: ThreadedGateway, extra: dict[str, Any], named: str  # noqa: F811
) -> None:
    answer = httpx.post(f"{served.url}/v1/responses", json={"input": "hi", **GREEDY, **extra},
                        headers={"Authorization": f"Bearer {client.api_key}"})  # fmt: skip
    assert answer.status_code in (400, 404), answer.text
    error = answer.json()["error"]
    assert named in error["message"] + str(error["param"]), error
    assert "x-specfleet-job-id" not in answer.headers
