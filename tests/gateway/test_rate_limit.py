"""Per-key limits over real HTTP against a real Redis: each one answers 429 with a Retry-After after which the
request passes, with the x-ratelimit-* headers; token reservations are corrected by what finished jobs used.
The limits' period is 2 s here (60 s in production) so that waiting out a Retry-After stays short."""

import time
from collections.abc import Iterator

import httpx
import openai
import pytest
import redis

from shared.settings import ServiceSettings
from tests.helpers.gateway import ThreadedGateway
from tests.helpers.played_worker import PlayedWorker
from tests.helpers.redis_fixtures import create_key

PERIOD_S = 2.0


@pytest.fixture
def limited(settings: ServiceSettings) -> Iterator[ThreadedGateway]:
    settings.rate_limit_period_s = PERIOD_S
    with ThreadedGateway(settings, default_key=False).start() as server:
        yield server


def _client(server: ThreadedGateway, redis_url: str, **limits: int) -> httpx.Client:
    secret = create_key(redis_url, "limited", **limits)[1]
    return httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {secret}"})


def _retry_after(response: httpx.Response) -> int:
    assert response.status_code == 429, response.text
    assert response.json()["error"]["code"] == "rate_limit_exceeded"
    retry_after = int(response.headers["retry-after"])
    assert 1 <= retry_after <= PERIOD_S
    return retry_after


def test_requests_per_period(limited: ThreadedGateway, redis_url: str) -> None:
    with _client(limited, redis_url, requests_per_min=2) as http:
        first = http.post("/v1/jobs", json={"prompt": "x"})
        assert first.status_code == 202 and first.headers["x-ratelimit-limit-requests"] == "2"
        assert first.headers["x-ratelimit-remaining-requests"] == "1"
        assert http.post("/v1/jobs", json={"prompt": "x"}).headers["x-ratelimit-remaining-requests"] == "0"
        refused = http.post("/v1/jobs", json={"prompt": "x"})
        retry_after = _retry_after(refused)
        assert refused.headers["x-ratelimit-remaining-requests"] == "0"
        assert refused.headers["x-ratelimit-reset-requests"].endswith("s")
        time.sleep(retry_after)  # the behaviour under test: the wait the server asked for is enough
        assert http.post("/v1/jobs", json={"prompt": "x"}).status_code == 202


def test_tokens_per_period(limited: ThreadedGateway, redis_url: str) -> None:
    body = {"prompt": "x" * 40, "max_tokens": 40}  # reserves 40 / 4 + 40 = 50 tokens
    with _client(limited, redis_url, tokens_per_min=100) as http:
        # the bucket refills continuously (100 tokens per 2 s here): a slow machine sees a few tokens back
        first = http.post("/v1/jobs", json=body)
        assert 50 <= int(first.headers["x-ratelimit-remaining-tokens"]) <= 60
        assert http.post("/v1/jobs", json=body).status_code == 202
        refused = http.post("/v1/jobs", json=body)
        retry_after = _retry_after(refused)
        assert int(refused.headers["x-ratelimit-remaining-tokens"]) < 50
        time.sleep(retry_after)
        assert http.post("/v1/jobs", json=body).status_code == 202
        too_big = http.post("/v1/jobs", json={"prompt": "x", "max_tokens": 101})
        assert too_big.status_code == 413 and too_big.json()["error"]["code"] == "request_too_large"


def test_reservations_are_corrected_by_what_jobs_used(
    settings: ServiceSettings, redis_url: str, rclient: redis.Redis
) -> None:
    body = {"prompt": "x" * 40, "max_tokens": 40}  # reserves 50 tokens; a job below uses 3 + 2
    with ThreadedGateway(settings, default_key=False).start() as server:  # period 60 s: no refill to speak of
        with _client(server, redis_url, tokens_per_min=100) as http:
            for _ in range(2):
                assert http.post("/v1/jobs", json=body).status_code == 202
            assert http.post("/v1/jobs", json=body).status_code == 429
            worker = PlayedWorker(rclient, settings)
            for _ in range(2):
                worker.emit(worker.take(), [1, 2], "ab", finish_reason="length")
            corrected = http.post("/v1/jobs", json=body)  # 2 x 5 used + 50 reserved now
            assert corrected.status_code == 202
            assert 40 - 1 <= int(corrected.headers["x-ratelimit-remaining-tokens"]) <= 40 + 2


def test_concurrent_jobs(
    limited: ThreadedGateway, redis_url: str, rclient: redis.Redis, settings: ServiceSettings
) -> None:
    with _client(limited, redis_url, max_concurrent_jobs=1) as http:
        job_id = http.post("/v1/jobs", json={"prompt": "x"}).json()["id"]
        refused = http.post("/v1/jobs", json={"prompt": "x"})
        assert _retry_after(refused) == settings.retry_after_s
        assert "concurrency" in refused.json()["error"]["message"]
        worker = PlayedWorker(rclient, settings)
        worker.emit(worker.take(), [1], "a", finish_reason="length")  # the job finishes: its slot is free
        assert http.get(f"/v1/jobs/{job_id}").json()["status"] == "succeeded"
        second = http.post("/v1/jobs", json={"prompt": "x"})
        assert second.status_code == 202
        assert (
            http.post(f"/v1/jobs/{second.json()['id']}/cancel").status_code == 200
        )  # cancelled frees it too
        assert http.post("/v1/jobs", json={"prompt": "x"}).status_code == 202


def test_the_openai_client_sees_429_with_retry_after(limited: ThreadedGateway, redis_url: str) -> None:
    secret = create_key(redis_url, "sdk", requests_per_min=1)[1]
    with openai.OpenAI(base_url=f"{limited.url}/v1", api_key=secret, max_retries=0, timeout=5) as client:
        with pytest.raises(openai.APITimeoutError):  # admitted; no worker here, so it waits (and times out)
            client.with_options(timeout=0.5).completions.create(model="m", prompt="x", max_tokens=2)
        with pytest.raises(openai.RateLimitError) as limited_error:
            client.completions.create(model="m", prompt="x", max_tokens=2)
    assert 1 <= int(limited_error.value.response.headers["retry-after"]) <= PERIOD_S
    assert limited_error.value.body["type"] == "rate_limit_error"  # type: ignore[index]
