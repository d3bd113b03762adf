"""Webhooks end to end: gateway (HTTP) -> engine worker (tiny model) -> outbox -> Celery worker -> receiver."""

import json
import time

import httpx
import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from shared import keys
from shared.settings import ServiceSettings
from tests.helpers.engine_worker import EngineThread
from tests.helpers.gateway import ThreadedGateway
from tests.helpers.played_worker import PlayedWorker
from tests.helpers.tasks import CeleryWorker, Receiver
from tests.helpers.waiting import wait_until


@pytest.fixture
def http(hook_settings: ServiceSettings, gateway: ThreadedGateway) -> httpx.Client:
    with httpx.Client(base_url=gateway.url, timeout=10) as client:
        yield client


def submit(http: httpx.Client, webhook: str, events: list[str], **extra: object) -> str:
    body = {
        "prompt": "def f(",
        "max_tokens": 4,
        "temperature": 0,
        "webhook": webhook,
        "webhook_events_filter": events,
        **extra,
    }
    response = http.post("/v1/jobs", json=body)
    assert response.status_code == 202, response.text
    return str(response.json()["id"])


def webhook_status(http: httpx.Client, job_id: str, event: str = "completed") -> dict:
    return (http.get(f"/v1/jobs/{job_id}").json().get("webhook_status") or {}).get(event)


def test_start_and_completed_are_signed_and_carry_the_job(
    http: httpx.Client, receiver: Receiver, celery_worker: CeleryWorker, engine_worker: EngineThread
) -> None:
    job_id = submit(http, receiver.url + "/hook", ["start", "completed"])
    calls = receiver.wait_for(
        lambda cs: {c.event for c in cs} == {"start", "completed"}, what="start + completed"
    )
    receiver.verify_all()
    by_event = {c.event: c for c in calls}
    assert len(calls) == 2
    assert by_event["start"].headers["webhook-id"] == f"msg_{job_id}_start"
    assert by_event["completed"].headers["webhook-id"] == f"msg_{job_id}_completed"
    job = by_event["completed"].json
    assert job["id"] == job_id and job["status"] == "succeeded" and job["usage"]["completion_tokens"] == 4
    assert by_event["start"].json["id"] == job_id and by_event["start"].json["started_at"] is not None
    got = wait_until(lambda: webhook_status(http, job_id), what="webhook_status on the job")
    assert got["state"] == "delivered" and got["attempts"] == 1 and got["status_code"] == 200
    final = http.get(f"/v1/jobs/{job_id}").json()
    assert final["output"] == job["output"] and final["status"] == "succeeded"


def test_output_events_carry_partial_output_with_distinct_ids(
    http: httpx.Client, receiver: Receiver, celery_worker: CeleryWorker, engine_worker: EngineThread
) -> None:
    job_id = submit(http, receiver.url + "/out", ["output"], max_tokens=48, ignore_eos=True)
    calls = receiver.wait_for(lambda cs: len(cs) >= 1, what="an output event")
    wait_until(lambda: http.get(f"/v1/jobs/{job_id}").json()["status"] == "succeeded", what="the job")
    calls = receiver.received()
    assert {c.event for c in calls} == {"output"}  # no start/completed: not in the filter
    assert len({c.headers["webhook-id"] for c in calls}) == len(calls)
    assert all(c.headers["webhook-id"].startswith(f"msg_{job_id}_output_") for c in calls)
    assert calls[0].json["output"]["token_ids"]  # some output already
    receiver.verify_all()


def test_a_failing_receiver_gets_the_same_event_on_the_4th_attempt(
    http: httpx.Client, receiver: Receiver, celery_worker: CeleryWorker, engine_worker: EngineThread
) -> None:
    receiver.script["/flaky"] = [503, 503, 503]
    job_id = submit(http, receiver.url + "/flaky", ["completed"])
    calls = receiver.wait_for(lambda cs: any(c.status_code == 200 for c in cs), what="the 4th attempt")
    assert [c.status_code for c in calls] == [503, 503, 503, 200]
    assert {c.headers["webhook-id"] for c in calls} == {f"msg_{job_id}_completed"}
    assert len({c.body for c in calls}) == 1  # the same message every time
    receiver.verify_all()
    got = wait_until(lambda: webhook_status(http, job_id), what="webhook_status")
    assert got["state"] == "delivered" and got["attempts"] == 4


def test_410_stops_retrying_and_exhausted_retries_are_recorded(
    http: httpx.Client,
    hook_settings: ServiceSettings,
    receiver: Receiver,
    celery_worker: CeleryWorker,
    engine_worker: EngineThread,
) -> None:
    receiver.script["/gone"] = [410, 200]
    receiver.script["/down"] = [500] * 20
    gone_id = submit(http, receiver.url + "/gone", ["completed"])
    down_id = submit(http, receiver.url + "/down", ["completed"])
    gone = wait_until(lambda: webhook_status(http, gone_id), what="the 410 outcome")
    assert gone["state"] == "gone" and gone["attempts"] == 1 and gone["status_code"] == 410
    down = wait_until(lambda: webhook_status(http, down_id), what="the exhausted retries")
    assert down["state"] == "failed" and down["attempts"] == hook_settings.webhook_max_attempts
    assert down["status_code"] == 500
    assert len(receiver.received("/gone")) == 1
    assert len(receiver.received("/down")) == hook_settings.webhook_max_attempts
    for job_id in (gone_id, down_id):  # a webhook failure never changes the job's own status
        assert http.get(f"/v1/jobs/{job_id}").json()["status"] == "succeeded"
    # the Celery worker's /metrics counted both ends and every retry
    scraped = httpx.get(f"http://127.0.0.1:{hook_settings.tasks_metrics_port}/metrics", timeout=10).text
    samples = {
        (s.name, s.labels.get("state")): s.value
        for family in text_string_to_metric_families(scraped) for s in family.samples
    }
    assert samples[("specfleet_webhook_deliveries_total", "gone")] == 1
    assert samples[("specfleet_webhook_deliveries_total", "failed")] == 1
    assert samples[("specfleet_webhook_retries_total", None)] == hook_settings.webhook_max_attempts - 1
    # ready, it settled its collector (shared/gc_pauses.py): start-up's objects frozen, that collection timed
    assert samples[("specfleet_gc_frozen_objects", None)] > 50_000
    gen2 = [s for f in text_string_to_metric_families(scraped) for s in f.samples
            if s.name == "specfleet_gc_pause_seconds_count" and s.labels["generation"] == "2"]
    assert gen2 and gen2[0].value >= 1


def test_completed_fires_for_cancelled_and_expired_jobs(
    http: httpx.Client,
    hook_settings: ServiceSettings,
    rclient: redis.Redis,
    receiver: Receiver,
    celery_worker: CeleryWorker,
) -> None:
    cancelled = submit(http, receiver.url + "/c", ["start", "completed"])
    assert http.post(f"/v1/jobs/{cancelled}/cancel").json()["status"] == "cancelled"
    expired = submit(http, receiver.url + "/e", ["completed"], ttl_s=0.05)
    expires_at = http.get(f"/v1/jobs/{expired}").json()["expires_at"]
    wait_until(lambda: time.time() > expires_at + 0.01, what="the ttl to pass")
    assert PlayedWorker(rclient, hook_settings).reader.pull(5) == []  # the pull expires it
    calls = receiver.wait_for(lambda cs: len(cs) == 2, what="two completed events")
    assert {(c.path, c.event, c.json["status"]) for c in calls} == {
        ("/c", "completed", "cancelled"),
        ("/e", "completed", "expired"),
    }
    receiver.verify_all()


def test_a_job_whose_stored_request_does_not_validate_still_gets_its_webhook(
    http: httpx.Client, rclient: redis.Redis, receiver: Receiver, celery_worker: CeleryWorker
) -> None:
    """The outbox reads a job's webhook fields alone: a request stored by another version (or changed in Redis)
    that no longer validates whole raised in the outbox, and its `completed` webhook never came."""
    job_id = submit(http, receiver.url + "/old", ["completed"])
    stored = json.loads(rclient.hget(keys.job_hash(job_id), "request"))
    rclient.hset(keys.job_hash(job_id), "request", json.dumps({**stored, "max_tokens": 0}))
    assert http.post(f"/v1/jobs/{job_id}/cancel").json()["status"] == "cancelled"
    calls = receiver.wait_for(lambda cs: len(cs) == 1, what="the completed event")
    assert (calls[0].path, calls[0].event, calls[0].json["status"]) == ("/old", "completed", "cancelled")
    receiver.verify_all()


@pytest.mark.parametrize(
    "url",
    [
        "http://10.0.0.1/hook",
        "http://169.254.169.254/latest/meta-data",
        "http://[fe80::1]/x",
        "http://0.0.0.0/",
    ],
)
def test_private_webhook_is_refused_at_submit(http: httpx.Client, url: str) -> None:
    response = http.post("/v1/jobs", json={"prompt": "x", "webhook": url})
    assert response.status_code == 422
    error = response.json()["error"]
    assert error["field"] == "webhook" and "non-public" in error["message"]


def test_loopback_is_refused_without_the_allowlist(
    settings: ServiceSettings, gateway: ThreadedGateway
) -> None:
    with httpx.Client(base_url=gateway.url) as client:
        response = client.post("/v1/jobs", json={"prompt": "x", "webhook": "http://127.0.0.1:9/hook"})
        assert response.status_code == 422 and response.json()["error"]["field"] == "webhook"
        assert (
            client.post("/v1/jobs", json={"prompt": "x", "webhook": "ftp://example.com/"}).status_code == 422
        )


def test_a_keys_own_webhook_secret_signs_its_jobs_webhooks(
    hook_settings: ServiceSettings,
    receiver: Receiver,
    celery_worker: CeleryWorker,
    engine_worker: EngineThread,
) -> None:
    from shared.webhook_signing import InvalidSignature, verify
    from tests.helpers.redis_fixtures import create_key

    assert hook_settings.redis_url is not None
    key, secret = create_key(hook_settings.redis_url, "tenant")
    assert key.webhook_secret.startswith("whsec_") and key.webhook_secret != receiver.secret
    with ThreadedGateway(hook_settings, default_key=False).start() as server:
        with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {secret}"}) as http:
            submit(http, receiver.url + "/tenant", ["completed"])
    call = receiver.wait_for(lambda cs: len(cs) == 1, what="the completed webhook")[0]
    verify(key.webhook_secret, call.headers, call.body)  # the tenant's secret signed it ...
    with pytest.raises(InvalidSignature):
        verify(receiver.secret, call.headers, call.body)  # ... not the service's
