"""Execution deadlines on a real worker loop over a real engine (tiny target, in a thread; and a `specfleet
worker` process) and a real Redis: a running job past its deadline fails `timeout` with its output so far; a
job pulled past it never runs; the worker's deadline counters move. The deadline arithmetic is tested alone."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import redis

from shared import keys
from shared.redis_server import free_port
from shared.schemas import JobRequest
from shared.settings import ServiceSettings
from tests.helpers.engine_worker import EngineThread
from tests.helpers.redis_fixtures import job_record, submit_job
from tests.helpers.waiting import wait_until
from workers.worker.deadlines import Deadlines, JobClock
from workers.worker.engine_metrics import EngineMetrics

LONG = {"prompt": "def f(x):", "max_tokens": 400, "temperature": 0, "ignore_eos": True}


def _final(client: redis.Redis, job_id: str) -> dict[str, str]:
    return wait_until(
        lambda: (f := job_record(client, job_id))["status"] not in ("queued", "running") and f,
        timeout_s=60,
        what=f"job {job_id} to finish",
    )


def test_deadline_counts_from_creation_with_timeout_s_else_from_first_start() -> None:
    clock = JobClock(created_at=100.0, started_at=160.0)
    assert clock.deadline_s(JobRequest(prompt="x", timeout_s=30), 300) == 130.0
    assert clock.deadline_s(JobRequest(prompt="x"), 300) == 460.0
    retried = JobClock(created_at=100.0, started_at=160.0, retried_at=1000.0)  # a dlq retry restarts both
    assert retried.deadline_s(JobRequest(prompt="x", timeout_s=30), 300) == 1030.0
    deadlines = Deadlines(default_timeout_s=300)
    assert deadlines.track("a", JobRequest(prompt="x", timeout_s=5), JobClock.of("1.0", "2.0")) < 0
    assert deadlines.past() == ["a"]
    deadlines.forget(["a"])
    assert deadlines.past() == []


def test_running_job_past_its_deadline_fails_timeout_with_partial_output(
    settings: ServiceSettings, rclient: redis.Redis, tiny_target: Path
) -> None:
    worker = EngineThread(settings, tiny_target, worker_id="deadline", model_name="tiny", max_num_seqs=2)
    worker.worker.metrics = metrics = EngineMetrics()
    worker.start()
    try:
        doomed = submit_job(rclient, settings, **LONG, timeout_s=3600)
        wait_until(
            lambda: int(rclient.hget(keys.job_hash(doomed), "completion_tokens") or 0) > 0,
            what="the long job to produce tokens",
        )
        # its hour passes: move the deadline the worker holds for it (the clock, not the check, is what we skip)
        worker.worker.deadlines.deadline_s[doomed] = time.time() - 1
        job = _final(rclient, doomed)
        assert metrics.registry.get_sample_value("specfleet_jobs_deadline_exceeded_streak") == 1
        other = submit_job(rclient, settings, **{**LONG, "max_tokens": 8})
        assert _final(rclient, other)["status"] == "succeeded"  # the worker goes on
    finally:
        worker.stop()
    assert job["status"] == "failed" and '"code":"timeout"' in job["error"]
    num_tokens = int(job["completion_tokens"])
    assert 0 < num_tokens < LONG["max_tokens"]
    assert len(job["token_ids"].split(",")) == num_tokens and job["text"]  # the partial output is kept
    job_metrics = json.loads(job["metrics"])  # and what it ran up, as a finished job's record has
    assert job_metrics["compute_s"] > 0 and job_metrics["cost"] >= 0
    assert metrics.registry.get_sample_value("specfleet_jobs_deadline_exceeded_total") == 1
    # a job that ended another way restarted the streak
    assert metrics.registry.get_sample_value("specfleet_jobs_deadline_exceeded_streak") == 0


def test_job_pulled_past_its_deadline_never_runs(
    settings: ServiceSettings, rclient: redis.Redis, tiny_target: Path
) -> None:
    job_id = submit_job(rclient, settings, **LONG, timeout_s=5)
    created_at = float(rclient.hget(keys.job_hash(job_id), "created_at") or 0)
    rclient.hset(keys.job_hash(job_id), "created_at", repr(created_at - 60))  # it waited a minute in the queue
    worker = EngineThread(settings, tiny_target, worker_id="late", model_name="tiny", max_num_seqs=2)
    worker.worker.metrics = metrics = EngineMetrics()
    worker.start()
    try:
        job = _final(rclient, job_id)
    finally:
        worker.stop()
    assert job["status"] == "failed" and '"code":"timeout"' in job["error"]
    assert int(job["completion_tokens"]) == 0
    assert metrics.registry.get_sample_value("specfleet_jobs_deadline_exceeded_streak") == 1


def test_worker_process_stops_a_long_job_at_the_default_deadline(
    settings: ServiceSettings, rclient: redis.Redis, tiny_pair: tuple[Path, Path], redis_url: str, tmp_path: Path
) -> None:
    """`specfleet worker` with job_timeout_s 0.05: a 480-token job (9,600 tok/s would finish it first; the tiny
    pair decodes ~2,500-2,900 tok/s alone since its LM head is native, so 0.3 s no longer sufficed) is stopped
    0.05 s after it started, and the worker's /metrics count it."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECFLEET_")}
    env.update({"REDIS_URL": redis_url, "SPECFLEET_JOB_TIMEOUT_S": "0.05", "SPECFLEET_WARM_UP": "false",
                "SPECFLEET_WORKER_METRICS_PORT": str(port), "SPECFLEET_IDLE_BLOCK_MS": "50"})
    target, draft = tiny_pair
    args = [sys.executable, "-m", "shared.cli", "worker", "--target", str(target), "--draft", str(draft),
            "--name", "slow", "--max-num-seqs", "1", "--num-threads", "1"]
    with open(tmp_path / "worker.log", "wb") as log:
        proc = subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        job_id = submit_job(rclient, settings, prompt="def f(x):", max_tokens=480, temperature=0, ignore_eos=True)
        job = wait_until(
            lambda: (f := job_record(rclient, job_id))["status"] not in ("queued", "running") and f,
            timeout_s=120, what="the job to end",
        )
        assert job["status"] == "failed" and '"code":"timeout"' in job["error"], (tmp_path / "worker.log").read_text()
        num_tokens = int(job["completion_tokens"])
        assert num_tokens < 480 and len(job["token_ids"].split(",") if job.get("token_ids") else []) == num_tokens
        text = httpx.get(f"http://127.0.0.1:{port}/metrics").text
        assert "specfleet_jobs_deadline_exceeded_total 1.0" in text
        assert 'specfleet_worker_jobs_finished_total{outcome="deadline_exceeded"} 1.0' in text
    finally:
        proc.terminate()
        proc.wait(timeout=30)
