"""The gateway's /metrics over real HTTP against real Redis: the queue gauges read at scrape time (depth and the
oldest waiting job's age per priority) and the responses counted by status code."""

import httpx
import redis
from prometheus_client.parser import text_string_to_metric_families

from shared.settings import ServiceSettings
from tests.helpers.gateway import ThreadedGateway
from tests.helpers.played_worker import PlayedWorker
from tests.helpers.waiting import wait_until


def scrape(http: httpx.Client) -> dict[tuple[str, tuple], float]:
    """(sample name, sorted labels) -> value"""
    text = http.get("/metrics").text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text) for s in family.samples
    }


def test_queue_age_and_response_codes(
    gateway: ThreadedGateway, rclient: redis.Redis, settings: ServiceSettings
) -> None:
    with httpx.Client(base_url=gateway.url, timeout=10) as http:
        before = scrape(http)
        assert before[("specfleet_queue_oldest_age_seconds", (("priority", "batch"),))] == 0.0
        for priority in ("batch", "default"):
            assert http.post("/v1/jobs", json={"prompt": "x", "priority": priority}).status_code == 202
        assert http.get("/v1/jobs/no-such-job").status_code == 404
        assert http.post("/v1/jobs", json={"prompt": ""}).status_code == 422

        def batch_job_aged() -> dict | None:
            now = scrape(http)
            return now if now[("specfleet_queue_oldest_age_seconds", (("priority", "batch"),))] > 0 else None

        now = wait_until(batch_job_aged, what="the waiting batch job to age")
        assert now[("specfleet_queue_depth", (("priority", "batch"),))] == 1
        assert now[("specfleet_queue_oldest_age_seconds", (("priority", "interactive"),))] == 0.0

        def count(values: dict, code: str) -> float:
            return values.get(("specfleet_http_responses_total", (("code", code),)), 0.0)

        assert count(now, "404") - count(before, "404") == 1
        assert count(now, "422") - count(before, "422") == 1
        assert count(now, "202") - count(before, "202") == 2

        worker = PlayedWorker(rclient, settings)  # takes the default job first, then the batch one
        worker.take()
        worker.take()
        after = scrape(http)
        assert after[("specfleet_queue_oldest_age_seconds", (("priority", "batch"),))] == 0.0  # taken: not waiting
        assert after[("specfleet_queue_depth", (("priority", "batch"),))] == 1  # held
