"""Cost per job: the split of a step's engine time by scheduled tokens, and a real worker loop (tiny target,
real Redis) writing each job's compute_s and cost into its record and its Prometheus counters."""

import json
from pathlib import Path

import pytest
import redis

from shared import keys
from shared.settings import ServiceSettings
from tests.helpers.engine_worker import EngineThread
from tests.helpers.played_worker import step_output
from tests.helpers.redis_fixtures import submit_job
from tests.helpers.waiting import wait_until
from workers.worker.cost import CostMeter
from workers.worker.engine_metrics import EngineMetrics


def test_a_step_is_split_by_scheduled_tokens_and_priced() -> None:
    meter = CostMeter(price_per_worker_hour=7.2)  # 0.002 a second
    meter.account(0.3, {"prefill": 20, "decode": 1, "spec": 9})  # 30 tokens: 0.2 / 0.01 / 0.09 s
    meter.account(0.1, {"decode": 1})
    meter.account(0.5, {})  # an idle step is charged to no one
    out = step_output("decode", [5], "x", finish_reason="length")
    assert meter.finished([out, step_output("spec", [1], "y")]) == [(pytest.approx(0.11), pytest.approx(0.00022))]
    assert out.metrics == {"compute_s": pytest.approx(0.11), "cost": pytest.approx(0.00022)}
    assert meter.take("prefill") == (pytest.approx(0.2), pytest.approx(0.0004))
    assert meter.take("decode") == (0.0, 0.0)  # taken when it finished


def test_worker_records_compute_and_cost_per_job(
    settings: ServiceSettings, rclient: redis.Redis, tiny_target: Path
) -> None:
    settings.price_per_worker_hour = 3600.0  # one unit a second: cost == compute_s
    worker = EngineThread(settings, tiny_target, worker_id="cost", model_name="tiny", max_num_seqs=4)
    worker.worker.metrics = metrics = EngineMetrics()
    worker.start()
    try:
        job_ids = [submit_job(rclient, settings, max_tokens=n, temperature=0, ignore_eos=True) for n in (4, 32)]
        jobs = [
            wait_until(lambda j=j: (f := rclient.hgetall(keys.job_hash(j)))["status"] == "succeeded" and f,
                       what="the job to succeed")
            for j in job_ids
        ]
    finally:
        worker.stop()
    figures = [json.loads(job["metrics"]) for job in jobs]
    assert all(f["compute_s"] > 0 and f["cost"] == pytest.approx(f["compute_s"]) for f in figures)
    assert figures[1]["compute_s"] > figures[0]["compute_s"]  # 32 decode steps carry more than 4
    total = sum(f["compute_s"] for f in figures)
    assert metrics.registry.get_sample_value("specfleet_worker_compute_seconds_total") == pytest.approx(total)
    assert metrics.registry.get_sample_value("specfleet_worker_cost_total") == pytest.approx(total)
