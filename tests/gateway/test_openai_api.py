"""The OpenAI-compatible API with the real `openai` client over HTTP: a real gateway (uvicorn), Redis and worker
(tiny random model pair), every call going through the queue."""

import gzip
from collections.abc import Iterator

import httpx
import openai
import pytest
import redis

from shared import keys
from shared.settings import ServiceSettings
from tests.helpers.engine_worker import EngineThread
from tests.helpers.gateway import ThreadedGateway
from tests.helpers.redis_fixtures import create_key
from tests.helpers.waiting import wait_until

MODEL = "target"  # the tiny pair's target directory name
GREEDY = {"model": MODEL, "temperature": 0, "max_tokens": 12}


@pytest.fixture
def served(engine_thread: EngineThread, settings: ServiceSettings) -> Iterator[ThreadedGateway]:
    with ThreadedGateway(settings, default_key=False).start() as server:
        wait_until(
            lambda: engine_thread.client.hget(keys.MODEL_INFO, "model"), what="the worker's model info"
        )
        yield server


@pytest.fixture
def secret(settings: ServiceSettings) -> str:
    assert settings.redis_url is not None
    return create_key(settings.redis_url, "tenant", requests_per_min=1000, tokens_per_min=10**6)[1]


@pytest.fixture
def client(served: ThreadedGateway, secret: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{served.url}/v1", api_key=secret, max_retries=0, timeout=60) as oai:
        yield oai


def _job(served: ThreadedGateway, secret: str, job_id: str) -> dict:
    response = httpx.get(f"{served.url}/v1/jobs/{job_id}", headers={"Authorization": f"Bearer {secret}"})
    assert response.status_code == 200
    return response.json()


def test_models_lists_the_served_target(client: openai.OpenAI, served: ThreadedGateway) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL  # it was a 404 "Not Found" in specfleet's error shape
    with pytest.raises(openai.NotFoundError) as unknown:
        client.models.retrieve("org/gpt-4")
    assert unknown.value.body["param"] == "model"  # type: ignore[index]
    assert unknown.value.body["message"] == f"the model `org/gpt-4` does not exist; this fleet serves `{MODEL}`"  # type: ignore[index]
    auth = {"Authorization": f"Bearer {client.api_key}"}
    for method, path, status in (("GET", "/v1/models/a%0Ab", 404), ("GET", "/v1/completions", 405)):
        unmatched = httpx.request(method, f"{served.url}{path}", headers=auth)  # no route: Starlette's answer
        assert unmatched.status_code == status and set(unmatched.json()["error"]) == {"message", "type", "param", "code"}


def test_completion_is_a_job_and_matches_its_stream(
    client: openai.OpenAI, served: ThreadedGateway, secret: str
) -> None:
    raw = client.completions.with_raw_response.create(
        prompt="def f(x):", extra_body={"ignore_eos": True}, **GREEDY
    )
    completion = raw.parse()
    job = _job(served, secret, raw.headers["x-specfleet-job-id"])
    choice = completion.choices[0]
    assert completion.object == "text_completion" and completion.model == MODEL
    assert choice.finish_reason == "length" and choice.text == job["output"]["text"]
    assert completion.usage is not None and completion.usage.completion_tokens == 12
    assert completion.usage.prompt_tokens == job["usage"]["prompt_tokens"] > 0
    assert completion.usage.total_tokens == completion.usage.prompt_tokens + 12
    assert job["priority"] == "interactive" and raw.headers["x-ratelimit-limit-requests"] == "1000"

    stream = client.completions.create(
        prompt="def f(x):",
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
        **GREEDY,
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text  # greedy: the same text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 12


def test_stream_interval_ms_sends_fewer_larger_chunks_of_the_same_text(client: openai.OpenAI) -> None:
    whole = client.completions.create(prompt="def f(x):", extra_body={"ignore_eos": True}, **GREEDY)
    stream = client.completions.create(
        prompt="def f(x):", stream=True, extra_body={"ignore_eos": True, "stream_interval_ms": 60_000}, **GREEDY
    )
    texts = [c.choices[0].text for c in stream if c.choices]
    assert "".join(texts) == whole.choices[0].text
    assert len([text for text in texts if text]) <= 2  # the first token at once, the rest with the end
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(prompt="x", extra_body={"stream_interval_ms": -5}, **GREEDY)
    assert bad.value.body["param"] == "stream_interval_ms"  # type: ignore[index]


def test_chat_sync_and_stream(client: openai.OpenAI) -> None:
    messages = [
        {"role": "system", "content": "You write Python."},
        {"role": "user", "content": [{"type": "text", "text": "a function"}]},
    ]
    chat = client.chat.completions.create(
        messages=messages, max_completion_tokens=10, **{**GREEDY, "max_tokens": None}
    )  # type: ignore[arg-type]
    assert chat.object == "chat.completion" and chat.choices[0].message.role == "assistant"
    assert chat.choices[0].finish_reason in ("stop", "length") and chat.usage is not None
    assert chat.usage.completion_tokens <= 10
    stream = client.chat.completions.create(
        messages=messages, stream=True, max_completion_tokens=10, **{**GREEDY, "max_tokens": None}
    )  # type: ignore[arg-type]
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.id == chunks[0].id and c.object == "chat.completion.chunk" for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == chat.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == chat.choices[0].finish_reason
    assert all(c.usage is None for c in chunks)  # no include_usage, no usage chunk


def test_errors_in_openai_shape(client: openai.OpenAI, served: ThreadedGateway) -> None:
    with pytest.raises(openai.BadRequestError) as bad_n:
        client.completions.create(prompt="x", n=17, **GREEDY)
    assert bad_n.value.body["param"] == "n" and "1 to 16 choices" in bad_n.value.body["message"]  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as empty:
        client.completions.create(prompt="", **GREEDY)
    assert empty.value.body["param"] == "prompt" and "empty" in empty.value.body["message"]  # type: ignore[index]
    with pytest.raises(openai.NotFoundError) as no_model:
        client.completions.create(prompt="x", model="gpt-4", max_tokens=2)
    assert no_model.value.body["param"] == "model"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as unknown:
        client.chat.completions.create(
            messages=[{"role": "user", "content": "x"}], extra_body={"bogus": 1}, **GREEDY
        )
    assert unknown.value.body["param"] == "bogus"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as penalty:
        client.chat.completions.create(
            messages=[{"role": "user", "content": "x"}], presence_penalty=2.5, **GREEDY
        )
    assert penalty.value.body["param"] == "presence_penalty"  # type: ignore[index]
    ignored = client.chat.completions.create(
        messages=[{"role": "user", "content": "x"}], user="u1", presence_penalty=0, logit_bias={}, **GREEDY
    )
    assert ignored.choices[0].finish_reason in (
        "stop",
        "length",
    )  # neutral OpenAI fields are accepted, ignored
    with openai.OpenAI(base_url=f"{served.url}/v1", api_key="sf-wrong", max_retries=0) as stranger:
        with pytest.raises(openai.AuthenticationError) as denied:
            stranger.models.list()
    assert denied.value.body["type"] == "authentication_error"  # type: ignore[index]
    malformed = httpx.post(
        f"{served.url}/v1/completions",
        content=b'{"prompt": ',
        headers={"Authorization": f"Bearer {client.api_key}", "content-type": "application/json"},
    )
    assert malformed.status_code == 400 and set(malformed.json()["error"]) == {
        "message",
        "type",
        "param",
        "code",
    }
    assert malformed.json()["error"]["message"].startswith("not valid JSON (")
    assert malformed.json()["error"]["param"] is None  # the body, not the parser's offset
    form = httpx.post(  # curl -d without -H: a form type
        f"{served.url}/v1/completions",
        content=b'{"prompt": "x", "max_tokens": 4}',
        headers={"Authorization": f"Bearer {client.api_key}", "content-type": "application/x-www-form-urlencoded"},
    )
    assert form.status_code == 415 and form.json()["error"]["code"] == "unsupported_media_type"
    assert "Content-Type `application/json`" in form.json()["error"]["message"]
    compressed = httpx.post(
        f"{served.url}/v1/completions",
        content=gzip.compress(b'{"prompt": "x", "max_tokens": 4}'),
        headers={"Authorization": f"Bearer {client.api_key}", "content-type": "application/json",
                 "content-encoding": "gzip"},
    )
    assert compressed.status_code == 415 and compressed.json()["error"]["code"] == "unsupported_media_type"
    not_finite = httpx.post(
        f"{served.url}/v1/completions",
        content=b'{"prompt": "x", "max_tokens": 4, "temperature": NaN}',
        headers={"Authorization": f"Bearer {client.api_key}", "content-type": "application/json"},
    )
    assert not_finite.status_code == 400
    assert not_finite.json()["error"]["message"] == "temperature: Input should be a finite number"
    for field, value in (("top_k", 2**63), ("seed", 2**64)):  # past the engine's ranges: refused here, not in a step
        too_large = httpx.post(
            f"{served.url}/v1/completions",
            json={"prompt": "x", "max_tokens": 4, "temperature": 1.0, field: value},
            headers={"Authorization": f"Bearer {client.api_key}"},
        )
        assert too_large.status_code == 400 and too_large.json()["error"]["param"] == field
    for extra, param in (({"best_of": 2}, "best_of"), ({"suffix": "}"}, "suffix")):  # params named (were null)
        with pytest.raises(openai.BadRequestError) as unsupported:
            client.completions.create(prompt="x", extra_body=extra, **GREEDY)
        assert unsupported.value.body["param"] == param  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as image:  # it said `messages.0.content.str: ... a valid string`
        client.chat.completions.create(
            messages=[{"role": "user", "content": [{"type": "text", "text": "x"},
                                                   {"type": "image_url", "image_url": {"url": "http://x/a.png"}}]}],
            **GREEDY,
        )
    assert image.value.body["param"] == "messages.0.content"  # type: ignore[index]
    assert "part 1 is of type `image_url`: only text parts" in image.value.body["message"]  # type: ignore[index]


def test_chat_fields_that_change_nothing_are_taken_and_the_others_refused_with_a_reason(
    client: openai.OpenAI, served: ThreadedGateway
) -> None:
    """OpenAI's chat fields at values that change nothing here answer as without them (they were 400 "Extra
    inputs are not permitted"); a field that would change the answer is refused, named, with its reason."""
    messages = [{"role": "user", "content": "def f(x):"}]
    plain = client.chat.completions.create(messages=messages, **GREEDY)  # type: ignore[arg-type]
    neutral = {"modalities": ["text"], "prompt_cache_key": "tenant-7", "safety_identifier": "user-1"}
    taken = client.chat.completions.create(messages=messages, extra_body=neutral, **GREEDY)  # type: ignore[arg-type]
    assert taken.choices[0].message.content == plain.choices[0].message.content
    chunks = client.chat.completions.create(
        messages=messages, stream=True, stream_options={"include_usage": True, "include_obfuscation": False},  # type: ignore[arg-type,typeddict-unknown-key]
        **GREEDY,
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == plain.choices[0].message.content
    refused = (
        ({"modalities": ["text", "audio"]}, "modalities", "only text output"),
        ({"reasoning_effort": "low"}, "reasoning_effort", "no reasoning modes"),
        ({"verbosity": "low"}, "verbosity", "no verbosity setting"),
        ({"audio": {"voice": "alloy", "format": "wav"}}, "audio", "only text output"),
        ({"prediction": {"type": "content", "content": "x"}}, "prediction", "predicted outputs"),
        ({"functions": [{"name": "f", "parameters": {}}]}, "functions", "use `tools`"),
        ({"function_call": "auto"}, "function_call", "use `tool_choice`"),
    )
    for extra, param, reason in refused:
        with pytest.raises(openai.BadRequestError) as bad:
            client.chat.completions.create(messages=messages, extra_body=extra, **GREEDY)  # type: ignore[arg-type]
        assert bad.value.body["param"] == param and reason in bad.value.body["message"], extra  # type: ignore[index]


def test_a_prompt_of_token_ids_is_the_prompt_those_tokens_spell(
    client: openai.OpenAI, served: ThreadedGateway, engine_thread: EngineThread
) -> None:
    """OpenAI's completions take the prompt as token ids too (or a list holding one such list): the same answer
    as the text they encode. An id past the vocabulary is a 400 naming `prompt`, before any job is queued."""
    from tokenizers import Tokenizer

    path = engine_thread.client.hget(keys.MODEL_INFO, "tokenizer_path")
    ids = Tokenizer.from_file(f"{path}/tokenizer.json").encode("def f(x):", add_special_tokens=False).ids
    text = client.completions.create(prompt="def f(x):", **GREEDY).choices[0].text
    assert client.completions.create(prompt=ids, **GREEDY).choices[0].text == text
    assert client.completions.create(prompt=[ids], **GREEDY).choices[0].text == text
    vocab = int(engine_thread.client.hget(keys.MODEL_INFO, "vocab_size"))
    with pytest.raises(openai.BadRequestError) as past:
        client.completions.create(prompt=[*ids, vocab], **GREEDY)
    assert past.value.body == {  # type: ignore[comparison-overlap]
        "message": f"prompt_token_ids: token id {vocab} is not in the model's vocabulary of {vocab}",
        "type": "invalid_request_error", "param": "prompt", "code": "invalid_request",
    }  # fmt: skip
    with pytest.raises(openai.BadRequestError, match="echo of a prompt given as token ids needs logprobs"):
        client.completions.create(prompt=ids, echo=True, **GREEDY)
    # an evaluation harness's loglikelihood call (lm-eval's): token ids, echo, logprobs, one token; it was refused
    scored = {"echo": True, "logprobs": 1, "model": MODEL, "temperature": 0, "max_tokens": 1}
    by_ids = client.completions.create(prompt=[ids, ids[:3]], **scored).choices  # type: ignore[call-overload]
    by_text = client.completions.create(prompt=["def f(x):", tokenizer_text(path, ids[:3])], **scored).choices  # type: ignore[call-overload]
    assert [c.model_dump() for c in by_ids] == [c.model_dump() for c in by_text]
    assert by_ids[0].text.startswith("def f(x):") and len(by_ids[0].logprobs.tokens) == len(ids) + 1  # type: ignore[union-attr]
    assert by_ids[0].logprobs.token_logprobs[0] is None  # type: ignore[union-attr]
    streamed = list(client.completions.create(prompt=ids, stream=True, **scored))  # type: ignore[call-overload]
    assert "".join(c.choices[0].text for c in streamed) == by_ids[0].text


def test_logit_bias_reaches_the_engine_and_a_bad_one_is_a_400_before_the_queue(
    client: openai.OpenAI, served: ThreadedGateway, secret: str, engine_thread: EngineThread
) -> None:
    """OpenAI's `logit_bias` (it was a 400 "not supported"): +100 forces its token, on completions and chat,
    streamed or not; /v1/jobs takes it too. A token id past the vocabulary, a bias out of [-100, 100], a key
    that is no token id, or over 300 entries: a 400 naming `logit_bias`, before any job."""
    forced = {"logit_bias": {"42": 100}}
    raw = client.completions.with_raw_response.create(prompt="def f(x):", **GREEDY, **forced)  # type: ignore[arg-type]
    job = _job(served, secret, raw.headers["x-specfleet-job-id"])
    assert job["output"]["token_ids"] == [42] * GREEDY["max_tokens"]
    text = raw.parse().choices[0].text
    assert text != client.completions.create(prompt="def f(x):", **GREEDY).choices[0].text
    streamed = client.completions.create(prompt="def f(x):", stream=True, **GREEDY, **forced)  # type: ignore[arg-type,call-overload]
    assert "".join(c.choices[0].text for c in streamed) == text
    messages = [{"role": "user", "content": "hi"}]
    chat = client.chat.completions.with_raw_response.create(messages=messages, **GREEDY, **forced)  # type: ignore[arg-type]
    assert _job(served, secret, chat.headers["x-specfleet-job-id"])["output"]["token_ids"] == [42] * GREEDY["max_tokens"]
    submitted = httpx.post(
        f"{served.url}/v1/jobs",
        json={"prompt": "def f(x):", "max_tokens": 4, "temperature": 0, "logit_bias": {"42": 100}},
        headers={"Authorization": f"Bearer {secret}", "Prefer": "wait=60"},
        timeout=90,
    ).json()
    assert submitted["output"]["token_ids"] == [42] * 4
    vocab = int(engine_thread.client.hget(keys.MODEL_INFO, "vocab_size"))
    bad = (
        ({str(vocab): 1}, f"token id {vocab} is not in the model's vocabulary of {vocab}"),
        ({"42": 100.5}, "less than or equal to 100"),
        ({"x": 1}, "valid integer"),
        ({str(i): 1 for i in range(301)}, "at most 300"),
    )
    for bias, reason in bad:
        response = httpx.post(
            f"{served.url}/v1/completions",
            json={"prompt": "def f(x):", **GREEDY, "logit_bias": bias},
            headers={"Authorization": f"Bearer {secret}"},
        )
        assert response.status_code == 400, (bias, response.text)
        error = response.json()["error"]
        assert error["param"].startswith("logit_bias") and reason in error["message"], error
        assert "x-specfleet-job-id" not in response.headers


def test_penalties_reach_the_engine(client: openai.OpenAI, served: ThreadedGateway, secret: str) -> None:
    """OpenAI's presence and frequency penalties (they were a 400 past 0) and vLLM's repetition_penalty: a
    penalized call answers what the same job through /v1/jobs answers, and not the unpenalized text (a random
    model repeats itself greedily; a strong penalty stops that); out of range is a 400 naming the field."""
    prompt = "def f(x):"
    long = {**GREEDY, "max_tokens": 24}
    plain = client.completions.create(prompt=prompt, **long).choices[0].text
    for penalties in ({"frequency_penalty": 2.0, "presence_penalty": 1.0}, {"repetition_penalty": 2.0}):
        extra = {k: v for k, v in penalties.items() if k == "repetition_penalty"}
        standard = {k: v for k, v in penalties.items() if k != "repetition_penalty"}
        raw = client.completions.with_raw_response.create(prompt=prompt, extra_body=extra, **long, **standard)  # type: ignore[arg-type]
        text = raw.parse().choices[0].text
        assert text != plain, penalties
        job = httpx.post(
            f"{served.url}/v1/jobs",
            json={"prompt": prompt, "max_tokens": 24, "temperature": 0, **penalties},
            headers={"Authorization": f"Bearer {secret}", "Prefer": "wait=60"},
            timeout=90,
        ).json()
        assert job["output"]["token_ids"] == _job(served, secret, raw.headers["x-specfleet-job-id"])["output"]["token_ids"]
    for bad, param in (({"frequency_penalty": -2.1}, "frequency_penalty"), ({"repetition_penalty": 0}, "repetition_penalty")):
        response = httpx.post(
            f"{served.url}/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "x"}], **GREEDY, **bad},
            headers={"Authorization": f"Bearer {secret}"},
        )
        assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text


def test_min_tokens_and_stop_token_ids(client: openai.OpenAI, served: ThreadedGateway, secret: str, engine_thread: EngineThread) -> None:
    """vLLM's `min_tokens` and `stop_token_ids` (they were 400 "Extra inputs are not permitted"): a stop token
    pushed by logit_bias ends the answer at once, or only once min_tokens tokens came; out of bounds is a 400."""
    body = {"prompt": "def f(x):", "logit_bias": {"42": 100}, "stop_token_ids": [42]}
    for min_tokens, want in ((0, [42]), (3, None)):
        raw = client.completions.with_raw_response.create(
            extra_body={k: v for k, v in {**body, "min_tokens": min_tokens}.items() if k != "prompt"},
            prompt="def f(x):", **GREEDY,
        )  # type: ignore[arg-type]
        answer = raw.parse().choices[0]
        ids = _job(served, secret, raw.headers["x-specfleet-job-id"])["output"]["token_ids"]
        assert answer.finish_reason == "stop"
        if want is not None:
            assert ids == want
        else:
            assert len(ids) == 4 and ids[-1] == 42 and 42 not in ids[:-1], ids
    vocab = int(engine_thread.client.hget(keys.MODEL_INFO, "vocab_size"))
    for bad, param in (({"min_tokens": 13}, None), ({"stop_token_ids": [vocab]}, "stop_token_ids"),
                       ({"stop_token_ids": [-1]}, "stop_token_ids"), ({"stop_token_ids": [2**40]}, "stop_token_ids"),
                       ({"stop_token_ids": ["7"]}, "stop_token_ids")):  # the negative and huge ones were a 500
        response = httpx.post(
            f"{served.url}/v1/completions",
            json={"prompt": "x", **GREEDY, **bad},
            headers={"Authorization": f"Bearer {secret}"},
        )
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert next(iter(bad)) in error["message"] and (error["param"] or "").startswith(param or ""), error


def test_min_p_reaches_the_engine(client: openai.OpenAI, served: ThreadedGateway, secret: str) -> None:
    """vLLM's `min_p` (it was 400 "Extra inputs are not permitted"): at 1 it keeps the likeliest token alone (or
    the tokens tied with it: the tiny target's bf16 logits tie now and then), so every token of a call sampled
    hot has the top logprob, on both routes, where without it some do not; out of [0, 1] is a 400."""
    hot = {"model": MODEL, "temperature": 1.8, "seed": 5, "max_tokens": 24}
    for min_p, want_top in ((None, False), (1.0, True)):
        extra = {"min_p": min_p} if min_p is not None else {}
        answer = client.completions.create(prompt="def f(x):", logprobs=1, extra_body=extra, **hot).choices[0]  # type: ignore[arg-type]
        assert answer.logprobs is not None and answer.logprobs.token_logprobs and answer.logprobs.top_logprobs
        tops = [max(top.values()) for top in answer.logprobs.top_logprobs]
        assert all(lp == top for lp, top in zip(answer.logprobs.token_logprobs, tops, strict=True)) is want_top
    messages = [{"role": "user", "content": "def f(x):"}]
    chat = client.chat.completions.create(
        messages=messages, logprobs=True, top_logprobs=1, extra_body={"min_p": 1}, **hot  # type: ignore[arg-type]
    ).choices[0]
    assert chat.logprobs is not None and chat.logprobs.content
    assert all(item.logprob == item.top_logprobs[0].logprob for item in chat.logprobs.content)
    for bad in (1.5, -0.1, "0.5"):
        response = httpx.post(
            f"{served.url}/v1/chat/completions",
            json={"messages": messages, **GREEDY, "min_p": bad},
            headers={"Authorization": f"Bearer {secret}"},
        )
        assert response.status_code == 400 and response.json()["error"]["param"] == "min_p", response.text


def test_allowed_token_ids(client: openai.OpenAI, served: ThreadedGateway, secret: str, engine_thread: EngineThread) -> None:
    """vLLM's `allowed_token_ids` (it was 400 "Extra inputs are not permitted"): a sampled answer keeps to them;
    an empty list, or an id past the vocabulary, is a 400 naming the field before any job."""
    allowed = list(range(200, 220))
    raw = client.completions.with_raw_response.create(
        prompt="def f(x):", model=MODEL, temperature=1.5, seed=3, max_tokens=24, extra_body={"allowed_token_ids": allowed}
    )  # type: ignore[arg-type]
    ids = _job(served, secret, raw.headers["x-specfleet-job-id"])["output"]["token_ids"]
    assert len(ids) == 24 and set(ids) <= set(allowed), ids
    vocab = int(engine_thread.client.hget(keys.MODEL_INFO, "vocab_size"))
    for bad in ([], [vocab], [1] * 10_001, [-1], ["5"]):
        response = httpx.post(
            f"{served.url}/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "x"}], **GREEDY, "allowed_token_ids": bad},
            headers={"Authorization": f"Bearer {secret}"},
        )
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"].startswith("allowed_token_ids"), response.text
        assert "x-specfleet-job-id" not in response.headers


def test_usage_says_how_much_of_the_prompt_the_prefix_cache_held(
    client: openai.OpenAI, served: ThreadedGateway, secret: str  # noqa: F811
) -> None:
    """The worker's engine keeps computed prompt blocks (workers/engine/prefix_cache.py): a second call on the same
    long prompt reports them in `usage.prompt_tokens_details.cached_tokens` (the job's usage: `cached_tokens`),
    and answers what the first did; the first reports none."""
    prompt = "def area(radius):\n    return 3.14159 * radius * radius\n" * 6  # a few 16-token blocks
    first = client.completions.with_raw_response.create(prompt=prompt, **GREEDY)
    second = client.completions.with_raw_response.create(prompt=prompt, **GREEDY)
    one, two = first.parse(), second.parse()
    assert one.usage is not None and one.usage.prompt_tokens_details is None
    assert two.usage is not None and two.usage.prompt_tokens_details is not None
    cached = two.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < two.usage.prompt_tokens and cached % 16 == 0, (cached, two.usage)
    assert two.choices[0].text == one.choices[0].text
    job = _job(served, secret, second.headers["x-specfleet-job-id"])
    assert job["usage"]["cached_tokens"] == cached and _job(served, secret, first.headers["x-specfleet-job-id"])["usage"]["cached_tokens"] is None


def test_skip_special_tokens(client: openai.OpenAI, served: ThreadedGateway, secret: str, engine_thread: EngineThread) -> None:
    """vLLM's `skip_special_tokens` (it was 400 "Extra inputs are not permitted"): EOS tokens pushed by logit_bias
    and run past with ignore_eos leave no text by default and their own text with it false; not a boolean: 400."""
    eos = min(engine_thread.worker.engine.eos_token_ids)  # the worker's engine, in this process
    extra = {"logit_bias": {str(eos): 100}, "ignore_eos": True}
    texts = [client.completions.create(prompt="def f(x):", extra_body={**extra, "skip_special_tokens": skip}, **GREEDY)  # type: ignore[arg-type]
             .choices[0].text for skip in (True, False)]  # fmt: skip
    assert texts[0] == "" and len(texts[1]) > 0 and texts[1] == texts[1][: len(texts[1]) // 12] * 12
    response = httpx.post(
        f"{served.url}/v1/completions",
        json={"prompt": "x", **GREEDY, "skip_special_tokens": "no"},
        headers={"Authorization": f"Bearer {secret}"},
    )
    assert response.status_code == 400 and response.json()["error"]["param"] == "skip_special_tokens"


def test_include_stop_str_in_output(client: openai.OpenAI, served: ThreadedGateway, secret: str) -> None:
    """vLLM's `include_stop_str_in_output` (it was 400 "Extra inputs are not permitted"): the answer ends with
    the stop string it met, whole and streamed; a non-boolean is a 400 naming the field."""
    long = {**GREEDY, "max_tokens": 24}
    text = client.completions.create(prompt="def f(x):", **long).choices[0].text
    stop = text[8:11]
    cut = text[: text.index(stop)]
    for extra, want in (({}, cut), ({"include_stop_str_in_output": True}, cut + stop)):
        answer = client.completions.create(prompt="def f(x):", stop=stop, extra_body=extra, **long).choices[0]  # type: ignore[arg-type]
        assert (answer.text, answer.finish_reason) == (want, "stop"), extra
        chunks = client.completions.create(prompt="def f(x):", stop=[stop], stream=True, extra_body=extra, **long)  # type: ignore[arg-type]
        assert "".join(c.choices[0].text for c in chunks if c.choices) == want
    response = httpx.post(
        f"{served.url}/v1/completions",
        json={"prompt": "x", **GREEDY, "stop": "x", "include_stop_str_in_output": "yes"},
        headers={"Authorization": f"Bearer {secret}"},
    )
    assert response.status_code == 400 and response.json()["error"]["param"] == "include_stop_str_in_output"


def test_a_chat_call_continues_the_assistant_s_message(client: openai.OpenAI, served: ThreadedGateway, secret: str) -> None:
    """vLLM's chat-template controls (they were 400 "Extra inputs are not permitted"): `continue_final_message`
    goes on from the assistant's text, so the answer is the completion of the rendered conversation (the tiny
    tokenizer has no template: one line a message); `add_generation_prompt: false` leaves the turn closed;
    what cannot hold is a 400 naming the field."""
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "def f(x):"}]
    rendered = {"user: hi\nassistant: def f(x):": {"add_generation_prompt": False, "continue_final_message": True},
                "user: hi\nassistant: def f(x):\n": {"add_generation_prompt": False}}  # fmt: skip
    for prompt, controls in rendered.items():
        chat = client.chat.completions.create(messages=messages, extra_body=controls, **GREEDY)  # type: ignore[arg-type]
        assert chat.choices[0].message.content == client.completions.create(prompt=prompt, **GREEDY).choices[0].text
        assert chat.usage is not None and chat.usage.prompt_tokens > 0
    for bad, param in (
        ({"continue_final_message": True}, "continue_final_message"),  # add_generation_prompt defaults to true
        ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
        ({"add_generation_prompt": "no"}, "add_generation_prompt"),
    ):
        response = httpx.post(
            f"{served.url}/v1/chat/completions",
            json={"messages": messages, **GREEDY, **bad},
            headers={"Authorization": f"Bearer {secret}"},
        )
        assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
    last_user = httpx.post(
        f"{served.url}/v1/chat/completions",
        json={"messages": messages[:1], **GREEDY, "continue_final_message": True, "add_generation_prompt": False},
        headers={"Authorization": f"Bearer {secret}"},
    ).json()["error"]
    assert last_user["param"] == "continue_final_message" and "the assistant's, not the user's" in last_user["message"]


def test_the_speculation_method_of_a_call(client: openai.OpenAI, served: ThreadedGateway, secret: str) -> None:
    """The job API's `speculative` on the OpenAI routes too (it was 400 "Extra inputs are not permitted"): each
    method gives the same greedy answer, `false` decodes plainly; another value is a 400 naming the field."""
    plain = client.completions.create(prompt="def f(x):", **GREEDY).choices[0].text
    for method in (False, "none", "ngram", True):
        raw = client.completions.with_raw_response.create(prompt="def f(x):", extra_body={"speculative": method}, **GREEDY)  # type: ignore[arg-type]
        assert raw.parse().choices[0].text == plain, method
        if method is False:
            assert _job(served, secret, raw.headers["x-specfleet-job-id"])["metrics"]["num_draft_tokens"] in (0, None)
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(messages=[{"role": "user", "content": "x"}], extra_body={"speculative": "warp"}, **GREEDY)  # type: ignore[arg-type]
    assert bad.value.body["param"] == "speculative"  # type: ignore[index]


def test_n_choices_are_a_job_each_sampled_with_seeds_of_their_own(
    client: openai.OpenAI, served: ThreadedGateway, secret: str
) -> None:
    """`n` (it was refused past 1): a job a choice, choice i sampled with seed + i; one answer with n choices, the
    prompt's tokens counted once; streamed, each chunk names its choice and the usage chunk sums them."""
    sampled = {"model": MODEL, "temperature": 1.0, "max_tokens": 8, "seed": 7}
    raw = client.completions.with_raw_response.create(prompt="def f(x):", n=3, **sampled)  # type: ignore[call-overload]
    job_ids = raw.headers["x-specfleet-job-id"].split(",")
    three = raw.parse()
    assert len(job_ids) == 3 and [c.index for c in three.choices] == [0, 1, 2]
    assert three.id == f"cmpl-{job_ids[0]}"
    jobs = [_job(served, secret, job_id) for job_id in job_ids]
    assert [c.text for c in three.choices] == [job["output"]["text"] for job in jobs]
    assert len({c.text for c in three.choices}) > 1  # seeds of their own: the choices differ
    assert three.usage.prompt_tokens == jobs[0]["usage"]["prompt_tokens"]  # type: ignore[union-attr]
    assert three.usage.completion_tokens == sum(job["usage"]["completion_tokens"] for job in jobs)  # type: ignore[union-attr]
    one = client.completions.create(prompt="def f(x):", **sampled)  # type: ignore[call-overload]
    assert one.choices[0].text == three.choices[0].text  # choice 0 is the call with n=1
    again = client.completions.create(prompt="def f(x):", n=3, **sampled)  # type: ignore[call-overload]
    assert [c.text for c in again.choices] == [c.text for c in three.choices]  # reproducible

    messages = [{"role": "user", "content": "def f(x):"}]
    chat = client.chat.completions.create(messages=messages, n=2, **sampled)  # type: ignore[call-overload]
    chunks = list(client.chat.completions.create(
        messages=messages, n=2, stream=True, stream_options={"include_usage": True}, **sampled,  # type: ignore[call-overload]
    ))  # fmt: skip
    for i, choice in enumerate(chat.choices):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == i]
        assert mine[0].delta.role == "assistant" and mine[-1].finish_reason == choice.finish_reason
        assert "".join(c.delta.content or "" for c in mine) == choice.message.content
    assert chunks[-1].usage == chat.usage and len({c.id for c in chunks}) == 1


def test_several_prompts_are_a_job_each_answered_in_one_call(
    client: openai.OpenAI, engine_thread: EngineThread
) -> None:
    """Completions take a list of prompts (texts, or token-id lists), as OpenAI and vLLM do and as evaluation
    harnesses send them (it was "give one prompt"): choice k * n + j is prompt k's choice j, each the answer of
    that prompt alone; the usage counts each prompt once."""
    from tokenizers import Tokenizer

    prompts = ["def f(x):", "class A:"]
    sampled = {"model": MODEL, "temperature": 1.0, "max_tokens": 6, "seed": 3}
    alone = [client.completions.create(prompt=p, n=2, **sampled) for p in prompts]  # type: ignore[call-overload]
    together = client.completions.create(prompt=prompts, n=2, **sampled)  # type: ignore[call-overload]
    assert [c.index for c in together.choices] == [0, 1, 2, 3]
    assert [c.text for c in together.choices] == [c.text for answer in alone for c in answer.choices]
    assert together.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)  # type: ignore[union-attr]
    assert together.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)  # type: ignore[union-attr]
    path = engine_thread.client.hget(keys.MODEL_INFO, "tokenizer_path")
    tokenizer = Tokenizer.from_file(f"{path}/tokenizer.json")
    ids = [tokenizer.encode(p, add_special_tokens=False).ids for p in prompts]
    as_ids = client.completions.create(prompt=ids, n=2, **sampled)  # type: ignore[call-overload]
    assert [c.text for c in as_ids.choices] == [c.text for c in together.choices]
    echoed = client.completions.create(prompt=prompts, echo=True, **GREEDY)
    assert [c.text[: len(p)] for c, p in zip(echoed.choices, prompts, strict=True)] == prompts
    streamed = list(client.completions.create(prompt=prompts, n=2, stream=True, **sampled))  # type: ignore[call-overload]
    for choice in together.choices:
        assert "".join(c.choices[0].text for c in streamed if c.choices[0].index == choice.index) == choice.text
    for prompt, n, message in (
        (["x"] * 65, 1, "at most 64 prompts"),
        (["x"] * 5, 13, "at most 64 jobs"),
        (["x", [1, 2]], 1, "all texts or all token-id lists"),  # it said `prompt.str: Input should be a valid string`
    ):
        with pytest.raises(openai.BadRequestError, match=message):
            client.completions.create(prompt=prompt, n=n, **GREEDY)


def test_a_choice_refused_by_the_keys_limits_cancels_the_ones_queued(
    served: ThreadedGateway, settings: ServiceSettings
) -> None:
    assert settings.redis_url is not None
    limited = create_key(settings.redis_url, "two at a time", max_concurrent_jobs=2)[1]
    with openai.OpenAI(base_url=f"{served.url}/v1", api_key=limited, max_retries=0, timeout=60) as oai:
        with pytest.raises(openai.RateLimitError):
            oai.completions.create(prompt="def f(x):", n=3, model=MODEL, max_tokens=480, extra_body={"ignore_eos": True})
    listed = httpx.get(f"{served.url}/v1/jobs", headers={"Authorization": f"Bearer {limited}"}).json()["data"]
    assert [job["status"] for job in listed] == ["cancelled", "cancelled"]  # the two queued before the refusal


def test_a_call_of_n_choices_counts_once_against_requests_per_minute(
    served: ThreadedGateway, settings: ServiceSettings
) -> None:
    """As OpenAI counts it: a call is one request, whatever its `n` or its prompts (each choice counted as one:
    a key of 2 requests a minute could not make one call of n=3)."""
    assert settings.redis_url is not None
    limited = create_key(settings.redis_url, "two a minute", requests_per_min=2)[1]
    with openai.OpenAI(base_url=f"{served.url}/v1", api_key=limited, max_retries=0, timeout=60) as oai:
        many = oai.completions.create(prompt="def f(x):", n=3, model=MODEL, max_tokens=2)
        assert len(many.choices) == 3
        prompts = oai.completions.create(prompt=["a", "b", "c"], model=MODEL, max_tokens=2)
        assert len(prompts.choices) == 3
        with pytest.raises(openai.RateLimitError):  # the third call
            oai.completions.create(prompt="def f(x):", model=MODEL, max_tokens=2)


def test_closing_a_stream_of_n_choices_cancels_every_job(
    client: openai.OpenAI, served: ThreadedGateway, secret: str
) -> None:
    raw = client.completions.with_raw_response.create(  # type: ignore[call-overload]
        prompt="def f(x):", stream=True, n=2, model=MODEL, temperature=0, max_tokens=480,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    job_ids = raw.headers["x-specfleet-job-id"].split(",")
    stream = raw.parse()
    next(iter(stream))
    stream.close()  # the client goes away mid-generation
    for job_id in job_ids:
        job = wait_until(
            lambda: (j := _job(served, secret, job_id))["status"] not in ("queued", "running") and j,  # noqa: B023
            what="the job to stop",
        )
        assert job["status"] == "cancelled" and job["usage"]["completion_tokens"] < 480


def tokenizer_text(path: str, ids: list[int]) -> str:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(f"{path}/tokenizer.json").decode(ids)


def test_closing_a_stream_cancels_its_job(
    client: openai.OpenAI, served: ThreadedGateway, secret: str
) -> None:
    raw = client.completions.with_raw_response.create(  # type: ignore[call-overload]
        prompt="def f(x):",
        stream=True,
        model=MODEL,
        temperature=0,
        max_tokens=480,
        extra_body={"ignore_eos": True},
    )
    job_id = raw.headers["x-specfleet-job-id"]
    stream = raw.parse()
    first = next(iter(stream))
    assert first.choices[0].text is not None
    stream.close()  # the client goes away mid-generation
    job = wait_until(
        lambda: (j := _job(served, secret, job_id))["status"] != "running" and j, what="the job to stop"
    )
    assert job["status"] == "cancelled" and job["usage"]["completion_tokens"] < 480


def test_a_dropped_call_cancels_its_job(served: ThreadedGateway, secret: str, rclient: redis.Redis) -> None:
    body = {"model": MODEL, "prompt": "def f(x):", "max_tokens": 480, "temperature": 0, "ignore_eos": True}
    with httpx.Client(base_url=served.url, headers={"Authorization": f"Bearer {secret}"}) as http:
        with pytest.raises(httpx.ReadTimeout):  # the client gives up 0.05 s in, while the job runs: the gateway
            # hears the connection close and cancels at once (a 0.25 s poll let the 480 tokens finish first)
            http.post("/v1/completions", json=body, timeout=httpx.Timeout(10, read=0.05))
    # the job id header never reached the client: find the job in Redis
    job_key = wait_until(lambda: next(rclient.scan_iter(keys.job_hash("*[0-9a-f]")), None), what="the job")
    job_id = job_key.removeprefix(keys.JOB_PREFIX)
    job = wait_until(
        lambda: (j := _job(served, secret, job_id))["status"] not in ("queued", "running") and j,
        what="the dropped call's job to stop",
    )
    assert job["status"] == "cancelled" and job["usage"]["completion_tokens"] < 480


def test_a_dropped_call_of_n_choices_cancels_every_job(served: ThreadedGateway, secret: str) -> None:
    body = {"model": MODEL, "prompt": "def f(x):", "max_tokens": 480, "temperature": 0, "ignore_eos": True, "n": 2}
    with httpx.Client(base_url=served.url, headers={"Authorization": f"Bearer {secret}"}) as http:
        with pytest.raises(httpx.ReadTimeout):  # the client gives up while its two jobs run
            http.post("/v1/completions", json=body, timeout=httpx.Timeout(10, read=0.05))

        def stopped() -> list[dict] | None:  # the key's jobs (GET /v1/jobs): the header never reached the client
            jobs = http.get("/v1/jobs").json()["data"]
            return jobs if len(jobs) == 2 and all(j["status"] not in ("queued", "running") for j in jobs) else None

        jobs = wait_until(stopped, what="the dropped call's jobs to stop")
    assert [(j["status"], j["usage"]["completion_tokens"] < 480) for j in jobs] == [("cancelled", True)] * 2


def test_jobs_outlive_their_client_when_configured(
    engine_thread: EngineThread,
    settings: ServiceSettings,
    secret: str,
) -> None:
    settings.cancel_on_disconnect = False
    with ThreadedGateway(settings, default_key=False).start() as server:
        with openai.OpenAI(base_url=f"{server.url}/v1", api_key=secret, max_retries=0) as client:
            raw = client.completions.with_raw_response.create(
                prompt="x",
                stream=True,
                model=MODEL,
                temperature=0,
                max_tokens=40,
                extra_body={"ignore_eos": True},
            )
            raw.parse().close()  # gone before the first token
        job_id = raw.headers["x-specfleet-job-id"]
        job = wait_until(
            lambda: (j := _job(server, secret, job_id))["status"] not in ("queued", "running") and j,
            what="the job to finish",
        )
    assert job["status"] == "succeeded" and job["usage"]["completion_tokens"] == 40
