"""Execution deadlines at the gateway: `timeout_s` in the job body, the `Cancel-After` header (jobs and OpenAI
routes), OpenAI's `timeout_s` extension field; bad values are a 4xx naming the field (real HTTP, real Redis)."""


import httpx
import pytest
import redis

from gateway.cancel_after import parse_duration_s
from shared import keys
from shared.schemas import stored_request
from tests.helpers.gateway import ThreadedGateway


@pytest.fixture
def http(gateway: ThreadedGateway) -> httpx.Client:
    with httpx.Client(base_url=gateway.url, timeout=10) as client:
        yield client


def _stored_timeout_s(rclient: redis.Redis, job_id: str) -> float | None:
    """The deadline the worker reads from the stored request (an unset one is not stored: None)."""
    return stored_request(str(rclient.hget(keys.job_hash(job_id), "request"))).timeout_s


@pytest.mark.parametrize(("text", "seconds"), [("30", 30.0), ("30s", 30.0), ("1m", 60.0), ("1h30m", 5400.0),
                                                ("250ms", 0.25), ("1.5s", 1.5)])
def test_durations(text: str, seconds: float) -> None:
    assert parse_duration_s(text) == seconds


@pytest.mark.parametrize("text", ["", "soon", "5d", "1m-", "-1s"])
def test_bad_durations(text: str) -> None:
    with pytest.raises(ValueError):
        parse_duration_s(text)


def test_timeout_from_body_or_header(http: httpx.Client, rclient: redis.Redis) -> None:
    body = {"prompt": "x", "max_tokens": 4}
    from_body = http.post("/v1/jobs", json={**body, "timeout_s": 12.5}).json()["id"]
    from_header = http.post("/v1/jobs", json=body, headers={"Cancel-After": "1m"}).json()["id"]
    body_wins = http.post("/v1/jobs", json={**body, "timeout_s": 3}, headers={"Cancel-After": "1m"}).json()["id"]
    default = http.post("/v1/jobs", json=body).json()["id"]
    assert _stored_timeout_s(rclient, from_body) == 12.5
    assert _stored_timeout_s(rclient, from_header) == 60.0
    assert _stored_timeout_s(rclient, body_wins) == 3.0
    assert _stored_timeout_s(rclient, default) is None  # the worker applies job_timeout_s from its first start


@pytest.mark.parametrize(("headers", "body", "field"), [
    ({"Cancel-After": "soon"}, {}, "Cancel-After"),
    ({"Cancel-After": "0s"}, {}, "Cancel-After"),
    ({}, {"timeout_s": 0}, "timeout_s"),
    ({}, {"timeout_s": 10 * 24 * 3600}, "timeout_s"),
])
def test_bad_deadlines_are_422_naming_the_field(
    http: httpx.Client, headers: dict[str, str], body: dict[str, object], field: str
) -> None:
    response = http.post("/v1/jobs", json={"prompt": "x", **body}, headers=headers)
    assert response.status_code == 422 and response.json()["error"]["field"] == field


def test_openai_routes_take_timeout_s_and_cancel_after(http: httpx.Client, rclient: redis.Redis) -> None:
    def job_of(headers: dict[str, str], **extra: object) -> str:
        # no worker runs: a streamed call's headers name its queued job (leaving cancels it; its record stays)
        body = {"prompt": "x", "max_tokens": 2, "stream": True, **extra}
        with http.stream("POST", "/v1/completions", json=body, headers=headers) as response:
            assert response.status_code == 200
            return response.headers["x-specfleet-job-id"]

    assert _stored_timeout_s(rclient, job_of({}, timeout_s=7)) == 7.0
    assert _stored_timeout_s(rclient, job_of({"Cancel-After": "2m"})) == 120.0
    bad = http.post("/v1/completions", json={"prompt": "x"}, headers={"Cancel-After": "never"})
    assert bad.status_code == 400 and "Cancel-After" in bad.text


def test_a_job_past_its_deadline_is_a_timeout_for_openai_clients(
    http: httpx.Client, engine_worker: object
) -> None:
    """400 tokens cannot be generated within 1 ms: the worker stops it (or never starts it) at its deadline."""
    body = {"prompt": "x", "max_tokens": 400, "ignore_eos": True, "timeout_s": 0.001}
    response = http.post("/v1/completions", json=body, timeout=60)
    assert response.status_code == 504 and response.json()["error"]["code"] == "timeout"
    job = http.get(f"/v1/jobs/{response.headers['x-specfleet-job-id']}").json()
    assert job["status"] == "failed" and job["error"]["code"] == "timeout"
