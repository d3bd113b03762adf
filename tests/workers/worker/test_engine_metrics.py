"""The worker's /metrics over real HTTP: a real `specfleet worker` process (tiny pair, speculating with its
draft; or a target with an EAGLE head, `--eagle`) runs jobs from a real Redis; its engine and speculation figures
are scraped and parsed."""

import contextlib
import gc
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from shared import keys
from shared.redis_server import free_port
from shared.settings import ServiceSettings
from tests.helpers.redis_fixtures import submit_job
from tests.helpers.waiting import wait_until
from tests.workers.engine_runs import greedy, make_engine
from workers.worker.engine_metrics import EngineMetrics, JobOutcome, SpecSnapshot, _accepted_length_histogram
from workers.worker.loop_time import LoopClock, LoopPart

ROOT = Path(__file__).resolve().parents[3]


@contextlib.contextmanager
def _worker(redis_url: str, tmp_path: Path, *models: str) -> Iterator[str]:
    """A real `specfleet worker` with `models` (its --target ... options), serving /metrics: its URL."""
    port = free_port()
    env = {
        **os.environ,
        "REDIS_URL": redis_url,
        "SPECFLEET_WORKER_METRICS_PORT": str(port),
        "SPECFLEET_IDLE_BLOCK_MS": "50",
        "SPECFLEET_HEARTBEAT_INTERVAL_S": "0.2",
        # the tiny draft costs what its target does, so lengths from measured costs would rightly draft
        # nothing; a fixed k makes every step speculate, and the speculation metrics are what this checks
        "SPECFLEET_ENGINE_IS_ADAPTIVE": "false",
    }
    args = [sys.executable, "-m", "shared.cli", "worker", *models, "--name", "metrics-worker", "--num-threads", "1"]
    with open(tmp_path / "worker.log", "wb") as log:
        proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    client = redis.Redis.from_url(redis_url)
    try:
        wait_until(lambda: proc.poll() is not None or client.zscore(keys.WORKERS_ZSET, "metrics-worker"),
                   timeout_s=120, interval_s=0.05, what="the worker to heartbeat")
        assert proc.poll() is None, (tmp_path / "worker.log").read_text()
        yield f"http://127.0.0.1:{port}/metrics"
    finally:
        client.close()
        proc.terminate()
        proc.wait(30)


@pytest.fixture
def metrics_worker(redis_url: str, tiny_pair: tuple[Path, Path], tmp_path: Path) -> Iterator[str]:
    target, draft = tiny_pair
    with _worker(redis_url, tmp_path, "--target", str(target), "--draft", str(draft)) as url:
        yield url


def _scrape(url: str) -> dict[str, list]:
    samples: dict[str, list] = {}
    for family in text_string_to_metric_families(httpx.get(url, timeout=10).text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append(sample)
    return samples


def _value(samples: dict[str, list], name: str) -> float:
    return float(samples[name][0].value)


def _loop_seconds(samples: dict[str, list]) -> dict[str, float]:
    return {s.labels["part"]: float(s.value) for s in samples["specfleet_worker_loop_seconds_total"]}


def test_worker_serves_engine_and_speculation_metrics(
    metrics_worker: str, rclient: redis.Redis, settings: ServiceSettings
) -> None:
    job_ids = [
        submit_job(rclient, settings, prompt="def f(x):", max_tokens=24, temperature=0, ignore_eos=True,
                   speculative="draft")
        for _ in range(3)
    ]
    for job_id in job_ids:
        wait_until(lambda j=job_id: rclient.hget(keys.job_hash(j), "status") == "succeeded", timeout_s=60,
                   what=f"job {job_id} to succeed")
    samples = wait_until(
        lambda: (s := _scrape(metrics_worker)) and _value(s, "specfleet_engine_ttft_seconds_count") >= 3 and s,
        timeout_s=10, what="three finished jobs in the scrape",
    )
    assert _value(samples, "specfleet_engine_time_per_output_token_seconds_count") >= 3
    used, free = _value(samples, "specfleet_engine_kv_blocks_used"), _value(samples, "specfleet_engine_kv_blocks_free")
    assert used >= 0 and free > 0
    queried = _value(samples, "specfleet_engine_prefix_cache_queried_tokens_total")
    assert queried > 0 and 0 <= _value(samples, "specfleet_engine_prefix_cache_hit_tokens_total") <= queried
    for gauge in ("specfleet_engine_batch_size", "specfleet_engine_waiting_seqs", "specfleet_engine_running_seqs"):
        assert gauge in samples
    steps = _value(samples, "specfleet_spec_steps_total")
    assert steps > 0  # the draft proposed and the target verified
    drafted = _value(samples, "specfleet_spec_draft_tokens_total")
    accepted = _value(samples, "specfleet_spec_accepted_tokens_total")
    assert 0 <= accepted <= drafted
    assert _value(samples, "specfleet_spec_emitted_tokens_total") == accepted + steps  # one bonus/recovered each
    assert _value(samples, "specfleet_spec_accepted_length_count") == steps  # one entry per sequence-step here
    assert _value(samples, "specfleet_spec_accepted_length_sum") == accepted
    positions = samples["specfleet_spec_acceptance_rate"]
    assert positions and all(0.0 <= s.value <= 1.0 for s in positions)
    assert _value(samples, "specfleet_spec_draft_seconds_total") > 0
    assert _value(samples, "specfleet_spec_verify_seconds_total") > 0
    assert "specfleet_spec_fallbacks_total" in samples and "specfleet_spec_vetoed_steps_total" in samples
    by_method = {s.labels["method"]: s.value for s in samples["specfleet_spec_method_steps_total"]}
    assert by_method == {"draft": steps}  # the same figures, labelled by the method that drafted
    assert _value(samples, "specfleet_engine_generated_tokens_total") == 3 * 24
    num_events = sum(1 for j in job_ids for _, e in rclient.xrange(keys.job_events(j)) if e["type"] == "token")
    wait_until(lambda: _value(_scrape(metrics_worker), "specfleet_worker_token_events_total") == num_events,
               timeout_s=10, what="the token events written in the scrape")  # fmt: skip
    finished = {s.labels["outcome"]: s.value for s in samples["specfleet_worker_jobs_finished_total"]}
    assert finished == {"succeeded": 3, "failed": 0, "deadline_exceeded": 0}
    assert _value(samples, "specfleet_jobs_deadline_exceeded_total") == 0
    assert _value(samples, "specfleet_jobs_deadline_exceeded_streak") == 0
    compiled = {(s.labels["model"], s.labels["bucket"]): s.value for s in samples["specfleet_engine_compiled"]}
    assert set(compiled) >= {("target", "decode"), ("draft", "decode")} and set(compiled.values()) == {0.0}  # off
    assert {s.labels["model"]: s.value for s in samples["specfleet_engine_compile_failures_total"]} == {
        "target": 0.0, "draft": 0.0}
    native = {s.labels["model"]: s.value for s in samples["specfleet_engine_native_attention"]}
    assert native == {"target": 1.0, "draft": 1.0}  # the default backend, built with the host's compiler
    # the collector settled after the warm-up (shared/gc_pauses.py): start-up's objects frozen, its collection timed
    assert _value(samples, "specfleet_gc_frozen_objects") > 50_000
    pauses = {s.labels["generation"]: s.value for s in samples["specfleet_gc_pause_seconds_count"]}
    assert pauses["2"] >= 1 and set(pauses) == {"0", "1", "2"}
    thresholds = {s.labels["generation"]: s.value for s in samples["specfleet_gc_threshold"]}
    assert thresholds == {str(g): float(t) for g, t in enumerate(gc.get_threshold())}  # the worker keeps CPython's
    # the loop's wall time by part (workers/worker/loop_time.py): it stepped the engine, handed the steps' writes
    # over, took the writer's reports, and waited on the queues
    loop = _loop_seconds(samples)
    assert set(loop) == {part.value for part in LoopPart}
    assert all(loop[part] > 0 for part in ("engine", "hand_off", "reports", "control")), sorted(loop.items())
    assert loop["pull"] >= 0  # the jobs may have come in one pull, or with an idle wait (charged to `idle`)
    assert loop["idle"] > 0  # before the jobs came, after they ended: counted as the wait goes
    assert 0 < _value(samples, "specfleet_worker_engine_steps_total") <= 3 * 24  # one token or more a job a step


def test_a_worker_given_an_eagle_head_drafts_with_it(
    redis_url: str, eagle_models: dict[str, Path], rclient: redis.Redis, settings: ServiceSettings, tmp_path: Path
) -> None:
    """`specfleet worker --eagle DIR` (as `bench e2e --model demo` starts the demo target's head)."""
    models = ("--target", str(eagle_models["target"]), "--eagle", str(eagle_models["copy_head"]))
    with _worker(redis_url, tmp_path, *models) as url:
        job_id = submit_job(rclient, settings, prompt="def f(x):", max_tokens=16, temperature=0, ignore_eos=True)
        wait_until(lambda: rclient.hget(keys.job_hash(job_id), "status") == "succeeded", timeout_s=60,
                   what=f"job {job_id} to succeed")  # fmt: skip
        samples = wait_until(
            lambda: (s := _scrape(url)) and _value(s, "specfleet_engine_ttft_seconds_count") >= 1 and s,
            timeout_s=10, what="the finished job in the scrape",
        )
    by_method = {s.labels["method"]: s.value for s in samples["specfleet_spec_method_steps_total"]}
    assert set(by_method) == {"eagle"} and by_method["eagle"] > 0


def test_accepted_length_histogram_is_cumulative() -> None:
    snapshot = SpecSnapshot(accepted_length_histogram={0: 5, 2: 3, 4: 1})
    family = _accepted_length_histogram(snapshot.accepted_length_histogram)
    buckets = {s.labels["le"]: s.value for s in family.samples if s.name.endswith("_bucket")}
    assert buckets == {"0": 5, "1": 5, "2": 8, "3": 8, "4": 9, "+Inf": 9}
    total = next(s.value for s in family.samples if s.name.endswith("_sum"))
    assert total == 2 * 3 + 4


def test_speculation_figures_by_method() -> None:
    snapshot = SpecSnapshot(
        by_method={"eagle": (10, 40, 30, 6, 40, 0.5, [0.9, 0.8]), "ngram": (2, 4, 0, 2, 2, 0.0, [0.0])}
    )
    metrics = EngineMetrics()
    metrics.spec.snapshot = snapshot
    value = metrics.registry.get_sample_value
    assert value("specfleet_spec_method_steps_total", {"method": "eagle"}) == 10
    assert value("specfleet_spec_method_mean_accepted_tokens", {"method": "eagle"}) == 4.0
    assert value("specfleet_spec_method_acceptance_rate", {"method": "eagle", "position": "1"}) == 0.8
    assert value("specfleet_spec_method_draft_seconds_total", {"method": "eagle"}) == 0.5
    assert value("specfleet_spec_method_rejected_tokens_total", {"method": "eagle"}) == 6
    assert value("specfleet_spec_method_rejection_rate", {"method": "eagle"}) == 6 / 36  # of the 36 judged
    assert value("specfleet_spec_method_rejection_rate", {"method": "ngram"}) == 1.0
    assert value("specfleet_spec_method_mean_accepted_tokens", {"method": "ngram"}) == 1.0


def test_deadline_streak_counts_timeouts_in_a_row() -> None:
    metrics = EngineMetrics()
    value = metrics.registry.get_sample_value
    for _ in range(4):
        metrics.job_finished(JobOutcome.DEADLINE_EXCEEDED)
    assert value("specfleet_jobs_deadline_exceeded_streak") == 4
    metrics.job_finished(JobOutcome.FAILED)  # any other end breaks the streak; the counter keeps counting
    assert value("specfleet_jobs_deadline_exceeded_streak") == 0
    for _ in range(5):
        metrics.job_finished(JobOutcome.DEADLINE_EXCEEDED)
    assert value("specfleet_jobs_deadline_exceeded_streak") == 5  # the alert's threshold
    assert value("specfleet_jobs_deadline_exceeded_total") == 9
    assert value("specfleet_worker_jobs_finished_total", {"outcome": "deadline_exceeded"}) == 9
    assert value("specfleet_worker_jobs_finished_total", {"outcome": "failed"}) == 1


def test_refreshes_while_busy_are_spaced_and_a_finish_is_seen_whole(tiny_target: Path) -> None:
    """A real engine's steps: between refreshes the gauges keep their value and tokens are only counted; the
    step that finishes a job refreshes everything (its tokens all counted), as does a step with no output."""
    engine = make_engine(tiny_target)
    engine.add_request("a", [1, 2, 3], greedy(max_tokens=12))
    engine.add_request("b", [4, 5], greedy(max_tokens=6))
    metrics = EngineMetrics()
    value = metrics.registry.get_sample_value
    metrics.update(engine, engine.step())  # the first step refreshes: nothing was refreshed yet
    assert value("specfleet_engine_running_seqs") == 2
    num_tokens = 2
    metrics._next_refresh_s = float("inf")  # as within REFRESH_INTERVAL_S of the last refresh, for good
    while "b" in {seq.request_id for seq in engine.scheduler.running}:
        outputs = engine.step()
        num_tokens += sum(len(out.new_token_ids) for out in outputs)
        metrics.update(engine, outputs)
        if not any(out.finished for out in outputs):  # counted, not refreshed
            assert value("specfleet_engine_generated_tokens_total") == 2
    assert value("specfleet_engine_generated_tokens_total") == num_tokens == 12  # b's finish: everything so far
    assert value("specfleet_engine_running_seqs") == 1 and value("specfleet_engine_ttft_seconds_count") == 1
    metrics._next_refresh_s = float("inf")
    while engine.num_unfinished():
        metrics.update(engine, engine.step())
    metrics.update(engine, [])  # idle
    assert value("specfleet_engine_generated_tokens_total") == 18
    assert value("specfleet_engine_running_seqs") == 0 and value("specfleet_engine_batch_size") == 0
    assert value("specfleet_worker_jobs_finished_total", {"outcome": "succeeded"}) == 2


def test_the_loop_clock_gives_each_part_the_time_since_the_last_charge() -> None:
    clock = LoopClock()
    time.sleep(0.02)  # before the restart: charged to nothing
    start_s = time.perf_counter()
    clock.restart()
    time.sleep(0.01)
    clock.charge(LoopPart.ENGINE)
    time.sleep(0.005)
    clock.charge(LoopPart.PULL)
    clock.charge(LoopPart.PULL)  # nothing passed since: nothing more
    elapsed_s = time.perf_counter() - start_s
    assert clock.seconds[LoopPart.ENGINE] >= 0.01 and clock.seconds[LoopPart.PULL] >= 0.005
    assert sum(clock.seconds.values()) <= elapsed_s  # the parts add up to the loop's time, nothing before it
    registry = CollectorRegistry()
    registry.register(clock)
    clock.num_engine_steps = 7
    assert registry.get_sample_value("specfleet_worker_loop_seconds_total", {"part": "engine"}) == (
        clock.seconds[LoopPart.ENGINE])
    assert registry.get_sample_value("specfleet_worker_loop_seconds_total", {"part": "idle"}) == 0.0
    assert registry.get_sample_value("specfleet_worker_engine_steps_total") == 7
    with clock.idling():  # a wait on the queues counts as it goes: a scrape during it sees it
        time.sleep(0.01)
        assert registry.get_sample_value("specfleet_worker_loop_seconds_total", {"part": "idle"}) >= 0.01
    assert clock.seconds[LoopPart.IDLE] >= 0.01
