"""`specfleet bench e2e` on a tiny setting: every phase runs against a real fleet; the JSON has the contract's
shape (no timing is asserted: this machine is shared and noisy)."""

import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from workers.bench.e2e_bench import E2EBenchPlan, bench_e2e
from workers.bench.e2e_fleet import children_of
from workers.bench.e2e_gc import GcSnapshot, during
from workers.bench.e2e_latency import request_mix, run_engine
from workers.bench.e2e_load import lost_tokens
from workers.bench.http_client import cpu_seconds
from workers.bench.report import machine_info, write_json
from workers.worker.loop_time import LoopPart

HEADLINES = (
    "fleet_ttft_overhead_ms_p50",
    "fleet_ttft_overhead_ms_p99",
    "fleet_tpot_overhead_ms_p50",
    "submit_rate_jobs_s",
    "submit_rate_vs_xadd_ceiling",
    "sse_streams",
    "sse_lost_tokens",
    "fleet_vs_engine_tokens_per_s_c1",
    "submit_gateway_cpu_ms_per_job",
)


def test_e2e_bench_json_shape(tiny_pair: tuple[Path, Path], tmp_path: Path) -> None:
    plan = E2EBenchPlan.tiny()
    result = bench_e2e(*tiny_pair, plan, work_dir=tmp_path / "fleet")
    out = tmp_path / "e2e.json"
    write_json(out, "e2e", machine_info(**result["engine"]), result["rows"], result["ratios"])

    doc = json.loads(out.read_text())
    assert set(doc) == {"bench", "machine", "rows", "ratios"} and doc["bench"] == "e2e"
    assert {"gateway.log", "worker.log"} <= {p.name for p in (tmp_path / "fleet").iterdir()}  # kept: read after a failure
    assert doc["machine"]["engine_torch_threads"] == plan.num_engine_threads
    assert doc["machine"]["native_build"] in ("host", "portable")  # the worker's, read from its /metrics
    assert set(HEADLINES) <= set(doc["ratios"])
    assert all(isinstance(v, float) for v in doc["ratios"].values())
    phases = {(r["phase"], r["system"]) for r in doc["rows"]}
    assert {("ceiling", "redis_xadd_pipelined"), ("submit", "gateway_x1"), ("sse", "gateway_x1")} <= phases
    latency = [r for r in doc["rows"] if r["phase"] == "latency"]
    assert {(r["system"], r["concurrency"]) for r in latency} == {
        (s, c) for s in ("fleet", "engine", "fleet_two_requests", "fleet_stream_interval") for c in plan.concurrencies
    } | {("engine_gapped", 1)}  # fleet: submit and stream in one request; fleet_two_requests: POST, then GET
    # /stream; fleet_stream_interval: as fleet, the requests with `stream_interval_ms`; engine_gapped: the engine
    # with the fleet's pause between jobs, at one client
    (gapped,) = [r for r in latency if r["system"] == "engine_gapped"]
    assert gapped["gap_ms"] >= 0 and doc["ratios"]["engine_gap_ms_c1"] == gapped["gap_ms"]
    assert {"engine_gapped_ttft_extra_ms_p50_c1", "fleet_ttft_overhead_ms_p50_c1_vs_gapped_engine"} <= set(doc["ratios"])
    assert all(r["num_requests"] == r["rounds"] * max(plan.min_requests, r["concurrency"] * plan.requests_per_client)
               for r in latency)  # the untimed warm-up rounds before them counted nowhere
    assert plan.warmup_rounds >= 1 and {r["warmup_rounds"] for r in latency if r["system"] in ("fleet", "engine")} == {
        plan.warmup_rounds
    }
    assert {r["rounds"] for r in latency if r["system"] != "fleet_two_requests"} == {plan.latency_rounds}
    assert doc["ratios"]["sse_streams"] == plan.num_sse_streams
    assert doc["ratios"]["sse_lost_tokens"] == 0  # every stream carried its job's tokens, in order
    (sse,) = [r for r in doc["rows"] if r["phase"] == "sse"]
    assert sse["out_of_order"] == 0 and sse["failed_jobs"] == 0
    assert 0 < sse["gateway_rss_mb"] <= sse["gateway_peak_rss_mb"] == doc["ratios"]["sse_gateway_peak_rss_mb"]
    assert {f"fleet_vs_engine_tokens_per_s_c{c}" for c in plan.concurrencies} <= set(doc["ratios"])
    assert {f"fleet_vs_engine_tokens_per_s_c{c}_two_requests" for c in plan.concurrencies} <= set(doc["ratios"])
    for r in latency:  # the fleet's TTFT split by the times Redis recorded (workers/bench/e2e_ttft.py)
        if r["system"] == "fleet":
            assert r["queued_ms_p50"] >= 0 and r["first_write_ms_p50"] >= 0
            assert 0 < r["engine_ms_p50"] <= r["first_write_ms_p50"] + 1  # the worker's engine's own, within it
            # (first_write is whole milliseconds, from the start's millisecond)
            assert r["submit_ms_p50"] > 0 and r["delivery_ms_p50"] >= 0  # the client's clock, Redis's
            # the CPU each process spent per generated token while the fleet rounds ran (/proc, 10 ms ticks)
            assert all(r[f"{name}_cpu_us_per_token"] >= 0 for name in ("gateway", "redis", "writer", "client",
                                                                        "worker"))  # fmt: skip
    assert {f"fleet_io_cpu_us_per_token_c{c}" for c in plan.concurrencies} <= set(doc["ratios"])
    assert {f"fleet_{name}_c{c}_stream_interval" for c in plan.concurrencies
            for name in ("vs_engine_tokens_per_s", "io_cpu_us_per_token", "tokens_per_event")} <= set(doc["ratios"])
    for r in latency:  # token events read: one or more tokens each
        if r["system"].startswith("fleet"):
            assert 1 <= r["tokens_per_event"] <= plan.max_tokens
    assert {f"fleet_ttft_{part}_ms_p50_c{c}" for c in plan.concurrencies
            for part in ("submit", "queued", "first_write", "engine", "delivery")} <= set(doc["ratios"])  # fmt: skip
    assert {f"fleet_ttft_engine_extra_ms_p50_c{c}" for c in plan.concurrencies} <= set(doc["ratios"])
    # the worker loop's wall time by part over the fleet rounds, from its /metrics (workers/bench/e2e_loop.py),
    # and the tokens an engine step made, the fleet's worker's and the in-process engine's
    for r in latency:
        if r["system"] in ("fleet", "fleet_stream_interval"):
            shares = [r[f"loop_{part}_share"] for part in LoopPart]
            assert all(0 <= share <= 1 for share in shares) and sum(shares) == pytest.approx(1.0)
            assert r["loop_engine_share"] > 0
        if r["system"] in ("fleet", "engine", "fleet_stream_interval"):
            assert 1 <= r["tokens_per_engine_step"] <= r["concurrency"] * plan.max_tokens
    for c in plan.concurrencies:
        assert 0 < doc["ratios"][f"fleet_loop_engine_share_c{c}"] <= 1
        assert 0 <= doc["ratios"][f"fleet_pulled_by_puller_share_c{c}"] <= 1  # its jobs, pulled by the worker
        assert doc["ratios"][f"fleet_vs_engine_tokens_per_step_c{c}"] > 0
    # the collections the latency and SSE phases caused, from the worker's and the gateway's /metrics
    for process in ("worker", "gateway"):
        assert doc["ratios"][f"fleet_gc_pause_s_{process}"] >= 0
        assert doc["ratios"][f"fleet_gc_pause_max_ms_le_{process}"] >= 0
    assert doc["ratios"]["fleet_gc_pauses_gateway"] > 0  # its requests' objects: young collections at least
    assert doc["machine"]["load_avg_1m_before"] >= 0
    cost = [r for r in doc["rows"] if r["phase"] == "cost"]  # from the jobs' own records, SD on and off
    assert {(r["speculation"], r["concurrency"]) for r in cost} == {
        (s, c) for s in ("on", "off") for c in plan.concurrencies
    }
    assert all(r["tokens"] == max(plan.min_requests, r["concurrency"] * plan.requests_per_client) * plan.max_tokens
               and r["compute_s_per_1k"] > 0 for r in cost)
    assert {f"cost_per_1k_sd_vs_plain_c{c}" for c in plan.concurrencies} <= set(doc["ratios"])
    # the mixed phase: interactive requests with and without a batch backlog, two tenants' batches
    mixed = {r["system"]: r for r in doc["rows"] if r["phase"] == "mixed"}
    assert set(mixed) == {"interactive_idle", "batch_alone", "interactive_under_batch", "batch_under_interactive"}
    assert mixed["interactive_idle"]["num_requests"] == plan.mixed.num_idle_interactive
    assert mixed["interactive_under_batch"]["num_requests"] >= 1
    # both backlogs the size the first one's rate asked for
    assert mixed["batch_alone"]["num_requests"] == mixed["batch_under_interactive"]["num_requests"]
    assert mixed["batch_alone"]["num_requests"] >= plan.mixed.num_batch_jobs
    assert {"mixed_interactive_ttft_p99_vs_idle", "mixed_batch_throughput_vs_alone", "mixed_batch_preemptions",
            "fairness_second_vs_first_at_half", "fairness_min_ratio"} <= set(doc["ratios"])  # fmt: skip
    last = [r for r in doc["rows"] if r["phase"] == "fairness"][-1]
    assert last["first_completed"] == last["second_completed"] == plan.mixed.fairness_lines


def test_an_engine_run_with_a_gap_sends_each_next_request_that_long_after_the_last_ended(
    tiny_pair: tuple[Path, Path],
) -> None:
    """run_engine(gap_s): every request still runs to its end, and one client's requests come at least the gap
    apart (the engine sleeps in between), so its run lasts at least the gaps it held."""
    from workers.engine.config import EngineConfig
    from workers.engine.engine import Engine

    target, _ = tiny_pair
    engine = Engine(EngineConfig(target_dir=str(target), kv_cache_mb=16, max_num_seqs=2, num_threads=1,
                                 speculative_method="none"), target)  # fmt: skip
    bodies = request_mix(3, 4)
    plain = run_engine(engine, bodies, 1)
    gapped = run_engine(engine, bodies, 1, gap_s=0.05)
    assert len(plain.ttft_s) == len(gapped.ttft_s) == 3 and plain.num_tokens == gapped.num_tokens == 12
    assert gapped.elapsed_s >= 2 * 0.05  # two gaps between three requests: slept, not stepped
    two_clients = run_engine(engine, request_mix(4, 4), 2, gap_s=0.05)  # each client's pause, the other runs on
    assert len(two_clients.ttft_s) == 4 and two_clients.num_tokens == 16


def test_gc_pauses_of_a_phase_are_the_difference_of_two_scrapes() -> None:
    before = GcSnapshot(count=10, seconds=0.3, buckets={0.001: 8, 0.1: 9, 0.25: 10, math.inf: 10})
    after = GcSnapshot(count=14, seconds=0.35, buckets={0.001: 11, 0.1: 12, 0.25: 14, math.inf: 14})
    got = during(before, after, "worker")  # 4 collections: 3 within 1 ms, the 4th within 250 ms
    assert got["fleet_gc_pauses_worker"] == 4
    assert got["fleet_gc_pause_s_worker"] == pytest.approx(0.05)
    assert got["fleet_gc_pause_max_ms_le_worker"] == 250
    assert during(after, after, "gateway") == {"fleet_gc_pauses_gateway": 0, "fleet_gc_pause_s_gateway": 0,
                                              "fleet_gc_pause_max_ms_le_gateway": 0}


def test_lost_tokens_counts_missing_extra_and_moved_tokens() -> None:
    assert lost_tokens([1, 2, 3], [1, 2, 3]) == 0
    assert lost_tokens([1, 2, 3], [1, 2]) == 1  # the last one missing
    assert lost_tokens([1, 2, 3], [1, 2, 3, 3]) == 1  # one repeated
    assert lost_tokens([1, 2, 3], [1, 3, 2]) == 2  # two out of place
    assert lost_tokens([1, 2], []) == 2


def test_the_worker_s_child_processes_are_found(tmp_path: Path) -> None:
    """The writer's CPU is read from the worker's children (/proc/<pid>/task/*/children)."""
    script = "import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)']); print(p.pid, flush=True); time.sleep(30)"
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        assert children_of(parent.pid) == [child]
        assert cpu_seconds(child) >= 0 and cpu_seconds(2**22 + 1) == 0.0  # a pid that is not there: 0
    finally:
        for pid in children_of(parent.pid):
            os.kill(pid, signal.SIGKILL)
        parent.kill()
        parent.wait()
        assert parent.stdout is not None
        parent.stdout.close()


def test_the_mixed_backlog_lasts_the_interactive_arrivals_asked_for_at_the_measured_rate() -> None:
    """sized_backlog: enough batch jobs to run through min_interactive_under_batch arrivals at a batch rate (the
    quick plan at ~1,900 tokens/s: 6 arrivals 2 s apart, 22,800 tokens, 179 jobs of 128), never fewer than
    the plan's."""
    from workers.bench.e2e_mixed import MixedPlan, sized_backlog

    plan = MixedPlan.quick()
    assert sized_backlog(plan, 1_900.0) == 179
    wanted_s = plan.interactive_interval_s * plan.min_interactive_under_batch
    for tokens_per_s in (50.0, 1_900.0, 12_345.0):
        num_jobs = sized_backlog(plan, tokens_per_s)
        assert num_jobs * plan.batch_max_tokens / tokens_per_s >= wanted_s or num_jobs == plan.num_batch_jobs
        assert (num_jobs - 1) * plan.batch_max_tokens / tokens_per_s < wanted_s or num_jobs == plan.num_batch_jobs
    assert sized_backlog(plan, 1.0) == plan.num_batch_jobs


def test_e2e_bench_mixed_alone_names_its_workers_build(tiny_pair: tuple[Path, Path], tmp_path: Path) -> None:
    """`--only mixed` runs the mixed phase alone (no in-process engine): its rows, and the machine block names the
    build of the native kernels the mixed phase's worker runs (read from its /metrics)."""
    plan = E2EBenchPlan.tiny()
    result = bench_e2e(*tiny_pair, plan, work_dir=tmp_path / "fleet", only="mixed")
    assert {r["phase"] for r in result["rows"]} == {"mixed", "fairness"}
    assert "fleet_vs_engine_tokens_per_s_c1" not in result["ratios"]
    assert result["engine"]["native_build"] in ("host", "portable")
