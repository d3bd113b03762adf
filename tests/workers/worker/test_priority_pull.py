"""A worker whose engine is full of batch work still takes an interactive job (its engine preempts a batch
one for it), takes no job it would not preempt for, and every job ends with exactly the tokens of a run
without preemption: nothing lost, nothing repeated (real Redis, real engine on the tiny model)."""

import threading
from pathlib import Path

import redis

from shared import keys
from shared.schemas import Priority
from shared.settings import ServiceSettings
from tests.helpers.redis_fixtures import job_record, submit_job
from workers.worker.engine_metrics import EngineMetrics
from workers.worker.main import Worker

JOB = {"prompt": "def f(x):", "temperature": 0, "ignore_eos": True}


def _worker(client: redis.Redis, settings: ServiceSettings, target: Path) -> Worker:
    from workers.engine.config import EngineConfig
    from workers.engine.engine import Engine

    cfg = EngineConfig(target_dir=str(target), kv_cache_mb=16, max_num_seqs=2, num_threads=1, dtype="float32",
                       speculative_method="none")  # fmt: skip
    worker = Worker(Engine(cfg, target), client, settings, worker_id="priority-test", metrics=EngineMetrics())
    thread = threading.Thread(target=worker.start)  # off the main thread: the test's signal handlers stay
    thread.start()
    thread.join()
    return worker


def _steps_until(worker: Worker, done: object, max_steps: int = 2000) -> None:
    for _ in range(max_steps):
        if done():  # type: ignore[operator]
            return
        worker.step()
    raise AssertionError("not done after the steps allowed")


def _tokens(client: redis.Redis, job_id: str) -> str:
    return str(job_record(client, job_id).get("token_ids") or "")


def test_a_full_engine_takes_an_interactive_job_and_preempts_batch_work_exactly(
    rclient: redis.Redis, settings: ServiceSettings, tiny_target: Path
) -> None:
    settings.warm_up = False
    settings.reclaim_interval_s = 3600.0
    worker = _worker(rclient, settings, tiny_target)
    try:
        batch = [submit_job(rclient, settings, max_tokens=60, priority="batch", **JOB) for _ in range(2)]
        _steps_until(worker, lambda: len(worker.running) == 2 and worker.engine.free_capacity() == 0)
        for _ in range(3):
            worker.step()
        queued_default = submit_job(rclient, settings, max_tokens=8, priority="default", **JOB)
        urgent = submit_job(rclient, settings, max_tokens=8, priority="interactive", **JOB)
        worker.step()  # pulls the interactive job (and the default one: the other batch job is preemptible)
        assert {urgent, queued_default} <= set(worker.leases)

        def statuses() -> list[str | None]:
            return [rclient.hget(keys.job_hash(j), "status") for j in [urgent, queued_default, *batch]]  # type: ignore[misc]

        _steps_until(worker, lambda: statuses()[0] == "succeeded")
        assert statuses()[2:] == ["running", "running"]  # the interactive job did not wait for the batch work
        _steps_until(worker, lambda: all(s == "succeeded" for s in statuses()) and not worker.leases)
        registry = worker.metrics.registry
        assert (
            registry.get_sample_value("specfleet_preemptions_total", {"priority": Priority.BATCH.value}) >= 2
        )
        assert (
            registry.get_sample_value("specfleet_preemptions_total", {"priority": Priority.INTERACTIVE.value})
            == 0
        )
        assert (
            registry.get_sample_value(
                "specfleet_ttft_seconds_count", {"priority": Priority.INTERACTIVE.value}
            )
            == 1
        )
        assert (
            registry.get_sample_value(
                "specfleet_queue_wait_seconds_count", {"priority": Priority.BATCH.value}
            )
            == 2
        )
        # each batch job's written tokens equal a run without preemption, on the same worker
        alone = submit_job(rclient, settings, max_tokens=60, priority="batch", **JOB)
        _steps_until(
            worker, lambda: rclient.hget(keys.job_hash(alone), "status") == "succeeded" and not worker.leases
        )
        for job_id in batch:
            assert _tokens(rclient, job_id) == _tokens(rclient, alone)
            assert (
                int(rclient.hget(keys.job_hash(job_id), "attempt") or 0) == 1
            )  # never handed back nor re-run
    finally:
        worker.request_stop(0.0)
        worker.shutdown()


def test_a_full_engine_pulls_nothing_it_would_not_preempt_for(
    rclient: redis.Redis, settings: ServiceSettings, tiny_target: Path
) -> None:
    settings.warm_up = False
    settings.reclaim_interval_s = 3600.0
    worker = _worker(rclient, settings, tiny_target)
    try:
        running = [submit_job(rclient, settings, max_tokens=400, priority="default", **JOB) for _ in range(2)]
        _steps_until(worker, lambda: sorted(worker.running) == sorted(running))
        waiting = [
            submit_job(rclient, settings, max_tokens=8, priority=p, **JOB) for p in ("default", "batch")
        ]
        for _ in range(5):
            worker.step()
        assert not set(waiting) & set(worker.leases)  # equal and lower priority wait in their queues
        assert [rclient.hget(keys.job_hash(j), "status") for j in waiting] == ["queued", "queued"]
    finally:
        worker.request_stop(0.0)
        worker.shutdown()
