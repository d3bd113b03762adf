"""Logprobs and echo through the OpenAI API with the real `openai` client: completions (`logprobs: N`, `echo`) and
chat (`logprobs`, `top_logprobs`), streaming and not, and the job API's `logprobs` / `prompt_logprobs`. Real
gateway (uvicorn), Redis and worker (tiny random model). That the values are the target's own log-softmax, with
speculation on or off, is tests/workers/engine/test_logprobs.py."""

import json
import math
from collections.abc import Iterator

import httpx
import openai
import pytest

from shared import keys
from shared.settings import ServiceSettings
from tests.helpers.engine_worker import EngineThread
from tests.helpers.gateway import ThreadedGateway
from tests.helpers.redis_fixtures import create_key
from tests.helpers.waiting import wait_until

MODEL = "target"
GREEDY = {"model": MODEL, "temperature": 0, "max_tokens": 8, "extra_body": {"ignore_eos": True}}


@pytest.fixture
def served(engine_thread: EngineThread, settings: ServiceSettings) -> Iterator[ThreadedGateway]:
    with ThreadedGateway(settings, default_key=False).start() as server:
        wait_until(lambda: engine_thread.client.hget(keys.MODEL_INFO, "model"), what="the worker's model info")
        yield server


@pytest.fixture
def secret(settings: ServiceSettings) -> str:
    assert settings.redis_url is not None
    return create_key(settings.redis_url, "tenant")[1]


@pytest.fixture
def client(served: ThreadedGateway, secret: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{served.url}/v1", api_key=secret, max_retries=0, timeout=60) as oai:
        yield oai


def test_completion_logprobs_and_echo(client: openai.OpenAI) -> None:
    plain = client.completions.create(prompt="def f(x):", logprobs=3, **GREEDY).choices[0]
    assert plain.logprobs is not None
    lp = plain.logprobs
    assert lp.tokens is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 8
    for logprob, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert top is not None and 1 <= len(top) <= 3  # (tokens with the same text share a key)
        assert logprob == pytest.approx(max(top.values()))  # greedy: the chosen token is the most likely
        assert math.fsum(math.exp(v) for v in top.values()) <= 1 + 1e-6
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0

    echoed = client.completions.create(prompt="def f(x):", logprobs=3, echo=True, **GREEDY).choices[0]
    assert echoed.text == "def f(x):" + plain.text
    elp = echoed.logprobs
    assert elp is not None and elp.tokens is not None and elp.token_logprobs is not None
    num_prompt = len(elp.tokens) - 8
    assert num_prompt >= 1 and "".join(elp.tokens[:num_prompt]) == "def f(x):"
    assert elp.token_logprobs[0] is None and all(v is not None and v <= 0 for v in elp.token_logprobs[1:])
    assert elp.tokens[num_prompt:] == lp.tokens
    assert elp.token_logprobs[num_prompt:] == pytest.approx(lp.token_logprobs, abs=1e-3)

    echo_only = client.completions.create(prompt="def f(x):", echo=True, **GREEDY).choices[0]
    assert echo_only.text == echoed.text and echo_only.logprobs is None


def test_completion_stream_carries_the_same_logprobs(client: openai.OpenAI) -> None:
    whole = client.completions.create(prompt="import os", logprobs=2, echo=True, **GREEDY).choices[0]
    chunks = [c for c in client.completions.create(
        prompt="import os", logprobs=2, echo=True, stream=True, **GREEDY
    ) if c.choices]  # fmt: skip
    assert "".join(c.choices[0].text for c in chunks) == whole.text
    tokens, values, offsets = [], [], []
    for chunk in chunks:
        if chunk.choices[0].logprobs is not None:
            tokens += chunk.choices[0].logprobs.tokens or []
            values += chunk.choices[0].logprobs.token_logprobs or []
            offsets += chunk.choices[0].logprobs.text_offset or []
    assert whole.logprobs is not None
    assert tokens == whole.logprobs.tokens and offsets == whole.logprobs.text_offset
    assert values[0] is None and values[1:] == pytest.approx(whole.logprobs.token_logprobs[1:], abs=1e-3)


def test_chat_logprobs_streaming_and_not(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "hello"}]
    whole = client.chat.completions.create(messages=messages, logprobs=True, top_logprobs=4, **GREEDY).choices[0]  # type: ignore[arg-type]
    assert whole.logprobs is not None and whole.logprobs.content is not None
    content = whole.logprobs.content
    assert len(content) == 8  # one per generated token
    decoded = b"".join(bytes(t.bytes or []) for t in content).decode("utf-8", errors="replace")
    assert decoded.startswith(whole.message.content)  # the tokens' own bytes (the text may hold back a partial char)
    for t in content:
        assert len(t.top_logprobs) == 4 and t.logprob == pytest.approx(t.top_logprobs[0].logprob)
        assert [x.logprob for x in t.top_logprobs] == sorted((x.logprob for x in t.top_logprobs), reverse=True)

    streamed = []
    for chunk in client.chat.completions.create(
        messages=messages, logprobs=True, top_logprobs=4, stream=True, **GREEDY  # type: ignore[arg-type]
    ):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed += chunk.choices[0].logprobs.content or []
    assert [t.token for t in streamed] == [t.token for t in content]
    assert [t.logprob for t in streamed] == pytest.approx([t.logprob for t in content], abs=1e-3)

    without = client.chat.completions.create(messages=messages, **GREEDY).choices[0]  # type: ignore[arg-type]
    assert without.logprobs is None and without.message.content == whole.message.content


def test_bad_logprobs_requests_are_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="logprobs"):
        client.completions.create(prompt="x", logprobs=6, **GREEDY)
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        client.chat.completions.create(messages=[{"role": "user", "content": "x"}], top_logprobs=2, **GREEDY)  # type: ignore[arg-type]
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        client.chat.completions.create(
            messages=[{"role": "user", "content": "x"}], logprobs=True, top_logprobs=21, **GREEDY  # type: ignore[arg-type]
        )


def test_the_job_api_returns_and_streams_logprobs(served: ThreadedGateway, secret: str) -> None:
    headers = {"Authorization": f"Bearer {secret}", "Prefer": "wait=60"}
    body = {"prompt": "def g(", "max_tokens": 5, "temperature": 0, "ignore_eos": True, "logprobs": 2, "prompt_logprobs": 1}
    with httpx.Client(base_url=served.url, headers=headers, timeout=60) as http:
        job = http.post("/v1/jobs", json=body).json()
        if job["status"] != "succeeded":
            job = wait_until(
                lambda: (j := http.get(f"/v1/jobs/{job['id']}").json())["status"] == "succeeded" and j,
                what="the job",
            )
        output = job["output"]
        assert [t["token_id"] for t in output["logprobs"]] == output["token_ids"]
        assert all(len(t["top_logprobs"]) == 2 for t in output["logprobs"])
        prompt = output["prompt_logprobs"]
        assert len(prompt) == job["usage"]["prompt_tokens"] and prompt[0]["logprob"] is None
        assert all(len(t["top_logprobs"]) == 1 for t in prompt[1:])
        events = []
        with http.stream("GET", f"/v1/jobs/{job['id']}/stream") as stream:
            for line in stream.iter_lines():
                if line.startswith("data:") and '"token_ids"' in line:
                    events.append(json.loads(line[5:]))
        assert [t for e in events for t in e["logprobs"]] == output["logprobs"]
        assert events[0]["prompt_logprobs"] == prompt
        bad = http.post("/v1/jobs", json={**body, "logprobs": 21})
        assert bad.status_code == 422 and bad.json()["error"]["field"] == "logprobs"
