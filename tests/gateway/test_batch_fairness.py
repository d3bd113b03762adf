"""Tenants' batches share the batch queue fairly (shared/batch_quota.py): two keys' batches submitted one
after the other progress together, and a key's unfinished lines count against its batch quota (429 past it).
Gateway (HTTP) -> Celery expansion -> engine worker (tiny model), all real."""

import httpx
import pytest

from shared.settings import ServiceSettings
from tests.gateway.test_batches_api import jsonl, request_line
from tests.helpers.engine_worker import EngineThread
from tests.helpers.gateway import ThreadedGateway
from tests.helpers.redis_fixtures import create_key
from tests.helpers.tasks import CeleryWorker
from tests.helpers.waiting import wait_until

NUM_LINES = 100
IN_FLIGHT_PER_KEY = 10


@pytest.fixture
def fair_settings(hook_settings: ServiceSettings) -> ServiceSettings:
    hook_settings.batch_max_inflight_lines_per_key = IN_FLIGHT_PER_KEY
    hook_settings.batch_chunk_lines = NUM_LINES  # without the quota, one task would queue a whole batch
    hook_settings.batch_max_pending_lines_per_key = 130
    return hook_settings


def tenant(gateway: ThreadedGateway, settings: ServiceSettings, name: str) -> httpx.Client:
    assert settings.redis_url is not None
    _, secret = create_key(settings.redis_url, name)
    return httpx.Client(base_url=gateway.url, timeout=30, headers={"Authorization": f"Bearer {secret}"})


def post_batch(client: httpx.Client, num_lines: int) -> httpx.Response:
    data = jsonl([request_line(i, "/v1/completions") for i in range(num_lines)])
    return client.post("/v1/batches", content=data, headers={"content-type": "application/jsonl"})


def test_two_tenants_batches_submitted_one_after_the_other_progress_together(
    fair_settings: ServiceSettings,
    gateway: ThreadedGateway,
    celery_worker: CeleryWorker,
    engine_worker: EngineThread,
) -> None:
    first, second = tenant(gateway, fair_settings, "first"), tenant(gateway, fair_settings, "second")
    with first, second:
        ids = []
        for client in (first, second):
            response = post_batch(client, NUM_LINES)
            assert response.status_code == 202, response.text
            ids.append(response.json()["id"])
        samples: list[tuple[int, int]] = []  # (first's completed lines, second's) over time

        def both_done() -> bool:
            counts = [c.get(f"/v1/batches/{i}").json() for c, i in zip((first, second), ids, strict=True)]
            samples.append(
                (counts[0]["request_counts"]["completed"], counts[1]["request_counts"]["completed"])
            )
            return all(c["status"] == "completed" for c in counts)

        wait_until(both_done, 300, 0.05, "both batches to complete")
    # one key has at most IN_FLIGHT_PER_KEY lines queued or running: the second batch never waits for the whole
    # first one (without the quota it would have 0 lines done when the first is half done)
    at_half = next(b for a, b in samples if a >= NUM_LINES // 2)
    assert at_half >= NUM_LINES // 2 - 4 * IN_FLIGHT_PER_KEY, samples  # measured 31 (without the quota: 0)


def test_a_batch_past_the_keys_pending_lines_is_429(
    fair_settings: ServiceSettings, gateway: ThreadedGateway
) -> None:
    with tenant(gateway, fair_settings, "heavy") as heavy, tenant(gateway, fair_settings, "light") as light:
        assert post_batch(heavy, 100).status_code == 202  # no Celery worker here: its lines stay unfinished
        refused = post_batch(heavy, 31)
        assert refused.status_code == 429 and refused.headers["retry-after"]
        error = refused.json()["error"]
        assert error["code"] == "rate_limit_exceeded" and "batch quota of 130" in error["message"]
        assert post_batch(heavy, 30).status_code == 202  # exactly up to the quota
        assert post_batch(light, 100).status_code == 202  # another key has its own
