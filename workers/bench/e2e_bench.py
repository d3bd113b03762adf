"""`specfleet bench e2e`: what the fleet (gateway + Redis + worker) costs on top of the engine, one run.

Every phase runs the fleet as `specfleet up` does: Redis, the gateway, the Celery worker, and the worker where a
phase needs one (workers/bench/e2e_fleet.py).

1. Redis ceilings: pipelined XADD, and the gateway's SUBMIT script (Redis's own cost of a job).
2. Submit rate with no worker running: many keep-alive clients POST /v1/jobs, a fixed count.
3. TTFT / time per output token, N closed-loop clients through the fleet (client clock, over SSE) vs the same
   request mix straight into an in-process engine (same engine settings and torch thread count as the worker),
   in `latency_rounds` interleaved rounds (fleet then engine, engine then fleet, ...), after `warmup_rounds`
   untimed rounds of each at that concurrency: each system's figures pool its rounds (tokens/s = all tokens
   over all seconds), so one noisy second moves neither side alone.
   A fleet client submits and streams in one request (POST /v1/jobs with `Accept: text/event-stream`, as a
   streaming OpenAI call); one more round per N with POST then GET /stream (`system` fleet_two_requests,
   ratios `..._two_requests`).
   With it, the cost per 1,000 tokens from the jobs' records, speculation on and off (workers/bench/e2e_cost.py).
   The fleet's TTFT split by the times Redis recorded: `submit_ms_p50` (request sent -> created),
   `queued_ms_p50` (created -> started), `first_write_ms_p50` (started -> first token written; of it
   `engine_ms_p50`, the worker's engine's own TTFT from the jobs' metrics, and ratio
   `fleet_ttft_engine_extra_ms_p50_c{N}`: that against the in-process engine's TTFT) and `delivery_ms_p50`
   (written -> read by the client) on its rows (workers/bench/e2e_ttft.py).
   A third system in the same interleaved rounds, `fleet_stream_interval`: the same requests with
   `stream_interval_ms` (`plan.stream_interval_ms`: a job's tokens in one event at most that often, the first
   token and the end at once), ratios `..._stream_interval`; every fleet row has `tokens_per_event`.
   Every fleet row has its worker loop's wall time by part (`loop_<part>_share`, from the worker's /metrics:
   workers/bench/e2e_loop.py), and fleet and engine rows the tokens an engine step made: ratios
   `fleet_loop_engine_share_c{N}` (the loop's time in the engine's step) and `fleet_vs_engine_tokens_per_step_c{N}`
   (the batch's fill against the in-process engine's).
   At one client, after those rounds, the engine once more with each next request held back by the fleet's TTFT
   overhead (`system` engine_gapped, `gap_ms`; workers/bench/e2e_latency.py `run_engine(gap_s=...)`): what the
   pause between jobs alone costs the engine's passes on this host (`engine_gapped_ttft_extra_ms_p50_c1`), and the
   fleet's TTFT overhead against that engine (`fleet_ttft_overhead_ms_p50_c1_vs_gapped_engine`). The headline
   overhead stays against the engine without the pause.
4. Many SSE streams (2,000) held at once by ONE gateway process, every token checked against the job's final
   output: in order, none missing, none repeated (`sse_lost_tokens`); the gateway's resident memory before and
   at its peak (sampled every 50 ms: `sse_gateway_peak_rss_mb`, `sse_gateway_kb_per_stream`).
   Over 3-4, the garbage collections they caused in the worker and the gateway, from each one's /metrics
   (`fleet_gc_pauses_<process>`, `fleet_gc_pause_s_<process>`, `fleet_gc_pause_max_ms_le_<process>`:
   workers/bench/e2e_gc.py). Run from the CLI, the benchmark's own process settles its collector as they do
   (shared/gc_pauses.py).
5. Mixed workloads (workers/bench/e2e_mixed.py): interactive TTFT under a saturating batch backlog against
   idle, batch throughput under an interactive trickle against alone, and two tenants' batches side by side.
   `only="mixed"` runs this phase alone.

Headline ratios: `fleet_vs_engine_tokens_per_s_c{N}` (fleet tokens/s over the in-process engine's, same request
mix, same minute), `fleet_ttft_overhead_ms_p50[_c{N}]`, `submit_rate_jobs_s` with the gateway's CPU per submit
(`submit_gateway_cpu_ms_per_job`), `sse_streams`, `sse_lost_tokens`, `cost_per_1k[_plain]_c{N}` and `cost_per_1k_sd_vs_plain_c{N}`; the machine's load average before and
after (the benchmark shares its cores with whatever else runs).

Everything runs on this machine: the benchmark client competes with the gateway, Redis and the worker for the
same cores, so its CPU use is reported too.
"""

import asyncio
import contextlib
import dataclasses
import logging
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch

from shared import cpu_placement, gc_pauses
from shared.redis_server import free_port
from shared.settings import ServiceSettings
from workers.bench import e2e_gc, e2e_loop
from workers.bench.e2e_cost import cost_ratios, cost_row, plain_run
from workers.bench.e2e_fleet import ROOT, BenchFleet
from workers.bench.e2e_latency import Timings, request_mix, run_engine, run_fleet, summary
from workers.bench.e2e_load import (
    hold_streams,
    raise_fd_limit,
    submit_rate,
    submit_script_ceiling,
    xadd_ceiling,
)
from workers.bench.e2e_mixed import MixedPlan, preemptions, run_fairness, run_mixed
from workers.bench.e2e_ttft import ttft_parts
from workers.bench.http_client import PeakResident, cpu_seconds, metric_samples, resident_mb

log = logging.getLogger(__name__)

# the processes `specfleet up` places on the I/O cores (shared/cpu_placement.py), and this benchmark's clients:
# their CPU per generated token is what one I/O core has to give (`fleet_io_cpu_us_per_token_c{N}`)
IO_PROCESSES = ("gateway", "redis", "writer", "celery", "client")


@dataclass(frozen=True)
class E2EBenchPlan:
    concurrencies: tuple[int, ...] = (1, 4, 16)
    requests_per_client: int = 4
    latency_rounds: int = 3  # per concurrency, alternating which system runs first
    # per concurrency, before those: one untimed round of the fleet and of the engine, so both are measured at
    # the concurrency's steady state (a fresh batch size's first round ran slower on both sides: the
    # speculation guard's and the length policy's learning, new pass shapes)
    warmup_rounds: int = 1
    min_requests: int = 16  # per concurrency level (bs1 gets this many, one after another)
    max_tokens: int = 32
    num_submit_jobs: int = 10_000
    num_submit_clients: int = 32
    num_ceiling_ops: int = 50_000
    num_sse_streams: int = 2_000
    sse_max_tokens: int = 16
    num_engine_threads: int = 1  # torch threads of the worker and of the in-process engine
    num_gateway_procs: int = 2  # the submit rate is measured with 1 and with this many; the rest with 1
    max_num_seqs: int = 32
    stream_interval_ms: int = 50  # of the latency phase's `fleet_stream_interval` requests
    mixed: MixedPlan = MixedPlan()

    @classmethod
    def quick(cls) -> "E2EBenchPlan":
        return cls(requests_per_client=2, min_requests=8, num_submit_jobs=3_000, num_ceiling_ops=16_000,
                   sse_max_tokens=8, mixed=MixedPlan.quick())

    @classmethod
    def tiny(cls) -> "E2EBenchPlan":
        """For tests: every phase, a few requests each (no figure means anything at this size)."""
        return cls(concurrencies=(1, 2), requests_per_client=1, min_requests=2, max_tokens=4,
                   num_submit_jobs=40, num_submit_clients=4, num_ceiling_ops=64, num_sse_streams=8,
                   sse_max_tokens=3, latency_rounds=1, warmup_rounds=1, num_gateway_procs=1, max_num_seqs=4,
                   mixed=MixedPlan.tiny())


def _latency_rows(fleet: BenchFleet, engine: Any, plan: E2EBenchPlan, price: float) -> list[dict[str, Any]]:
    """Per concurrency: fleet and engine in interleaved rounds (the same minutes of machine noise), one fleet
    round with POST then GET /stream, then the fleet again with speculation off (the cost phase's baseline)."""
    rows: list[dict[str, Any]] = []
    for c in plan.concurrencies:
        bodies = request_mix(max(plan.min_requests, c * plan.requests_per_client), plan.max_tokens)
        for _ in range(plan.warmup_rounds):  # untimed: the concurrency's steady state on both sides
            asyncio.run(run_fleet(fleet.endpoint, bodies, c))
            with _on_engine_cpus(fleet):
                run_engine(engine, bodies, c)
        systems = _interleaved(fleet, engine, bodies, c, plan)
        for system, t in systems.items():
            rows.append({"phase": "latency", "system": system, "concurrency": c, "rounds": plan.latency_rounds,
                         "warmup_rounds": plan.warmup_rounds, **summary(t)})  # fmt: skip
            if system.startswith("fleet"):  # where the fleet's first tokens waited
                rows[-1].update(ttft_parts(fleet.redis_url, t))
        fleet_t = systems["fleet"]
        fleet_row, engine_row = rows[-3], rows[-2]
        two = asyncio.run(run_fleet(fleet.endpoint, bodies, c, one_request=False))
        rows.append({"phase": "latency", "system": "fleet_two_requests", "concurrency": c, "rounds": 1,
                     **summary(two)})  # fmt: skip
        log.info("concurrency %d: fleet ttft p50 %.1f ms (POST then GET: %.1f ms), engine %.1f ms", c,
                 fleet_row["ttft_ms_p50"], rows[-1]["ttft_ms_p50"], engine_row["ttft_ms_p50"])
        if c == 1:  # the engine with its jobs as far apart as the fleet's: what the pause alone costs its passes
            gap_ms = max(0.0, fleet_row["ttft_ms_p50"] - engine_row["ttft_ms_p50"])
            gapped = Timings()
            with _on_engine_cpus(fleet):
                for _ in range(plan.latency_rounds):
                    gapped.merge(run_engine(engine, bodies, c, gap_ms / 1e3))
            rows.append({"phase": "latency", "system": "engine_gapped", "concurrency": c,
                         "rounds": plan.latency_rounds, "gap_ms": gap_ms, **summary(gapped)})  # fmt: skip
        rows.append(cost_row(fleet.redis_url, fleet_t, c, True, price))
        rows.append(cost_row(fleet.redis_url, plain_run(fleet.endpoint, bodies, c), c, False, price))
    return rows


def _interleaved(
    fleet: BenchFleet, engine: Any, bodies: list[dict[str, Any]], concurrency: int, plan: E2EBenchPlan
) -> dict[str, Timings]:
    """system -> its timings over `plan.latency_rounds` rounds: `fleet`, `engine` and `fleet_stream_interval`
    (the same bodies with `plan.stream_interval_ms`), the order rotating round by round."""
    order = ["fleet", "engine", "fleet_stream_interval"]
    timed = {system: Timings() for system in order}
    spaced = [{**body, "stream_interval_ms": plan.stream_interval_ms} for body in bodies]
    for i in range(plan.latency_rounds):
        for system in order[i % 3 :] + order[: i % 3]:
            if system == "engine":
                with _on_engine_cpus(fleet):
                    timed[system].merge(run_engine(engine, bodies, concurrency))
            else:
                timed[system].merge(_fleet_round(fleet, spaced if system != "fleet" else bodies, concurrency))
    return {system: timed[system] for system in ("fleet", "engine", "fleet_stream_interval")}


def _fleet_round(fleet: BenchFleet, bodies: list[dict[str, Any]], concurrency: int) -> Timings:
    """One fleet round, with the CPU seconds each process spent while it ran (`client`: this process) and the
    worker loop's seconds by part and engine steps (workers/bench/e2e_loop.py)."""
    url = fleet.worker_metrics_url
    loop_before = e2e_loop.scrape(url) if url else None
    before = {**fleet.cpu_seconds(), "client": cpu_seconds()}
    timings = asyncio.run(run_fleet(fleet.endpoint, bodies, concurrency))
    after = {**fleet.cpu_seconds(), "client": cpu_seconds()}
    timings.cpu_s = {name: after[name] - before.get(name, 0.0) for name in after}
    if url and loop_before is not None:
        loop = e2e_loop.scrape(url).since(loop_before)
        timings.loop_s, timings.num_engine_steps = loop.seconds, int(loop.num_engine_steps)
        timings.num_pulled = {by: int(num) for by, num in loop.num_pulled.items()}
    return timings


def worker_native_build(metrics_url: str) -> str | None:
    """The build the worker's native kernels come from (`specfleet_engine_native_build` on its /metrics), or None
    where it exports none (no native kernels)."""
    for sample in metric_samples(metrics_url):
        if sample.name == "specfleet_engine_native_build" and sample.value == 1.0:
            return str(sample.labels["build"])
    return None


def _on_engine_cpus(fleet: BenchFleet) -> contextlib.AbstractContextManager[None]:
    """The block on the fleet engine's cores: the in-process engine, and the submit phase's clients."""
    return cpu_placement.bound(fleet.placement.engine_cpus if fleet.placement else None)


def _overheads(rows: list[dict[str, Any]]) -> dict[str, float]:
    ratios: dict[str, float] = {}
    by_c: dict[int, dict[str, dict[str, Any]]] = {}
    for r in rows:
        if r["phase"] == "latency":
            by_c.setdefault(r["concurrency"], {})[r["system"]] = r
    for c, pair in sorted(by_c.items()):
        engine_tokens_per_s = pair["engine"]["tokens_per_s"]
        if engine_tokens_per_s > 0:
            ratios[f"fleet_vs_engine_tokens_per_s_c{c}"] = pair["fleet"]["tokens_per_s"] / engine_tokens_per_s
        if engine_tokens_per_s > 0 and "fleet_two_requests" in pair:  # POST, then GET /stream
            two = pair["fleet_two_requests"]
            ratios[f"fleet_vs_engine_tokens_per_s_c{c}_two_requests"] = two["tokens_per_s"] / engine_tokens_per_s
            ratios[f"fleet_ttft_overhead_ms_p50_c{c}_two_requests"] = two["ttft_ms_p50"] - pair["engine"]["ttft_ms_p50"]
        fleet_row, engine_row = pair["fleet"], pair["engine"]
        for part in ("submit_ms_p50", "queued_ms_p50", "first_write_ms_p50", "engine_ms_p50", "delivery_ms_p50"):
            if part in fleet_row:  # the fleet's TTFT, split (workers/bench/e2e_ttft.py)
                ratios[f"fleet_ttft_{part}_c{c}"] = fleet_row[part]
        if "engine_ms_p50" in fleet_row:  # the worker's engine's own TTFT against the in-process engine's
            ratios[f"fleet_ttft_engine_extra_ms_p50_c{c}"] = fleet_row["engine_ms_p50"] - engine_row["ttft_ms_p50"]
        if "engine_gapped" in pair:  # the engine with the fleet's pause between jobs (one client)
            gapped = pair["engine_gapped"]
            ratios[f"engine_gap_ms_c{c}"] = gapped["gap_ms"]
            ratios[f"engine_gapped_ttft_extra_ms_p50_c{c}"] = gapped["ttft_ms_p50"] - engine_row["ttft_ms_p50"]
            ratios[f"fleet_ttft_overhead_ms_p50_c{c}_vs_gapped_engine"] = fleet_row["ttft_ms_p50"] - gapped["ttft_ms_p50"]
        if "loop_engine_share" in fleet_row:  # the worker loop's time in the engine's step (e2e_loop.py)
            ratios[f"fleet_loop_engine_share_c{c}"] = fleet_row["loop_engine_share"]
        if "pulled_by_puller_share" in fleet_row:  # jobs pulled while the engine stepped (workers/worker/puller.py)
            ratios[f"fleet_pulled_by_puller_share_c{c}"] = fleet_row["pulled_by_puller_share"]
        if fleet_row.get("tokens_per_engine_step") and engine_row.get("tokens_per_engine_step"):
            ratios[f"fleet_vs_engine_tokens_per_step_c{c}"] = (  # the batch's fill against the in-process engine's
                fleet_row["tokens_per_engine_step"] / engine_row["tokens_per_engine_step"]
            )
        for system, suffix in (("fleet", ""), ("fleet_stream_interval", "_stream_interval")):
            io = [pair.get(system, {}).get(f"{name}_cpu_us_per_token") for name in IO_PROCESSES]
            if all(value is not None for value in io):
                ratios[f"fleet_io_cpu_us_per_token_c{c}{suffix}"] = sum(cast(list[float], io))
        if "fleet_stream_interval" in pair and engine_tokens_per_s > 0:
            spaced = pair["fleet_stream_interval"]
            ratios[f"fleet_vs_engine_tokens_per_s_c{c}_stream_interval"] = spaced["tokens_per_s"] / engine_tokens_per_s
            ratios[f"fleet_ttft_overhead_ms_p50_c{c}_stream_interval"] = spaced["ttft_ms_p50"] - pair["engine"]["ttft_ms_p50"]
            ratios[f"fleet_tokens_per_event_c{c}_stream_interval"] = spaced["tokens_per_event"]
            ratios[f"fleet_tokens_per_event_c{c}"] = pair["fleet"]["tokens_per_event"]
        for metric in ("ttft_ms_p50", "ttft_ms_p99", "tpot_ms_p50", "tpot_ms_p99"):
            name = f"fleet_{metric.split('_')[0]}_overhead_ms_{metric.rsplit('_', 1)[1]}"
            value = pair["fleet"][metric] - pair["engine"][metric]
            ratios[f"{name}_c{c}"] = value
            if c == min(by_c):  # the headline: one client, nothing else queued
                ratios[name] = value
    return ratios


def bench_e2e(
    target_dir: Path,
    draft_dir: Path | None,
    plan: E2EBenchPlan,
    work_dir: Path | None = None,
    only: str | None = None,
    settle_gc: bool = False,
    eagle_dir: Path | None = None,
) -> dict[str, Any]:
    """Every phase, or only the one named (`mixed`); eagle_dir: the target's EAGLE head, the fleet's worker and
    the in-process engine alike (the demo target's: as `specfleet up` serves the demo pair). settle_gc: this process settles its garbage collector once
    its in-process engine is warm, as the fleet's processes do (the `specfleet bench` commands; not in tests,
    where a freeze would keep what later tests drop from ever being collected)."""
    from workers.engine.config import EngineConfig

    settings = ServiceSettings()
    rows: list[dict[str, Any]] = []
    ratios: dict[str, float] = {}
    load_before = os.getloadavg()[0]
    num_fds = raise_fd_limit(2 * plan.num_sse_streams + 1024)  # the fleet's processes inherit it
    log.info("open files limit %d; load average %.2f", num_fds, load_before)
    metrics_port = free_port()
    env = {"SPECFLEET_WORKER_METRICS_PORT": str(metrics_port), "SPECFLEET_BATCH_RETRY_S": "0.25",
           "SPECFLEET_BATCH_MAX_INFLIGHT_LINES_PER_KEY": str(plan.mixed.fairness_inflight_lines_per_key)}
    with tempfile.TemporaryDirectory(prefix="specfleet-e2e-") as tmp:
        fleet = BenchFleet(Path(work_dir or tmp), target_dir, draft_dir, num_gateway_procs=1,
                           num_engine_threads=plan.num_engine_threads, max_num_seqs=plan.max_num_seqs, env=env,
                           eagle_dir=eagle_dir)  # fmt: skip
        io_cpus = fleet.placement.io_cpus if fleet.placement else None
        with fleet, cpu_placement.bound(io_cpus):  # this process is the fleet's clients: on the I/O cores
            cfg = EngineConfig.load(ROOT / settings.engine_config, num_threads=plan.num_engine_threads,
                                    max_num_seqs=plan.max_num_seqs)  # fmt: skip
            if only != "mixed":
                cfg = _fleet_phases(fleet, plan, settings, target_dir, draft_dir, rows, ratios, metrics_port,
                                    settle_gc)
            # 5: mixed workloads, on a worker with the phase's slots
            fleet.start_gateway(1)
            fleet.reset_data()
            fleet.start_worker(plan.mixed.max_num_seqs)
            if only == "mixed":  # no in-process engine: the machine block names this worker's build
                from workers.engine.native_build import NativeBuild

                build = worker_native_build(f"http://127.0.0.1:{metrics_port}/metrics")
                cfg = dataclasses.replace(cfg, native_build=NativeBuild(build) if build else cfg.native_build)
            mixed_rows, mixed_ratios = run_mixed(fleet.endpoint, plan.mixed)
            mixed_ratios["mixed_batch_preemptions"] = preemptions(metrics_port)
            fairness_rows, fairness_ratios = run_fairness(
                [fleet.tenant_endpoint("first"), fleet.tenant_endpoint("second")], plan.mixed
            )
            rows += mixed_rows + fairness_rows
            ratios.update(mixed_ratios | fairness_ratios)
    info = {**_engine_info(cfg, plan), "cpu_placement": fleet.placement.describe() if fleet.placement else "off",
            "load_avg_1m_before": load_before, "load_avg_1m_after": os.getloadavg()[0]}
    return {"rows": rows, "ratios": ratios, "engine": info}


def _fleet_phases(
    fleet: BenchFleet,
    plan: E2EBenchPlan,
    settings: ServiceSettings,
    target_dir: Path,
    draft_dir: Path | None,
    rows: list[dict[str, Any]],
    ratios: dict[str, float],
    worker_metrics_port: int,
    settle_gc: bool,
) -> Any:
    """Phases 1-4 (the module's docstring): their rows and ratios are added to `rows` and `ratios`; -> the
    in-process engine's config (its speculation method resolved)."""
    from workers.engine.config import EngineConfig
    from workers.engine.engine import Engine

    # 1-2: no worker yet
    rows.extend(_ceiling_rows(fleet, plan, settings))
    for procs in sorted({1, plan.num_gateway_procs}):
        fleet.start_gateway(procs)
        rows.append(_submit_row(fleet, plan))
    ratios.update(_submit_ratios(rows))
    fleet.start_gateway(1)  # as `specfleet up` runs it

    # 3: latency, fleet vs engine
    fleet.start_worker()
    torch.set_num_threads(plan.num_engine_threads)
    eagle_dir = fleet.eagle_dir
    warm = request_mix(2, 4)
    asyncio.run(run_fleet(fleet.endpoint, warm, 1))  # first-call allocations on both sides
    worker_metrics_url = f"http://127.0.0.1:{worker_metrics_port}/metrics"
    # the worker's build of the native kernels: both engines run the same products (each would time its own)
    cfg = EngineConfig.load(ROOT / settings.engine_config, target_dir=str(target_dir),
                            draft_dir=str(draft_dir) if draft_dir else None,
                            eagle_dir=str(eagle_dir) if eagle_dir else None,
                            num_threads=plan.num_engine_threads, max_num_seqs=plan.max_num_seqs,
                            native_build=worker_native_build(worker_metrics_url))
    with _on_engine_cpus(fleet):
        engine = Engine(cfg, target_dir, draft_dir, eagle_dir)
        engine.warm_pass_shapes()  # as the fleet's worker did in its warm-up
        run_engine(engine, warm, 1)
    if settle_gc:
        gc_pauses.settle()  # this process (the clients, the in-process engine) as the fleet's processes do
    gc_sources = {"worker": (worker_metrics_url, ()),
                  "gateway": (f"{fleet.url}/metrics", fleet.admin_headers())}
    gc_before = {process: e2e_gc.scrape(*source) for process, source in gc_sources.items()}
    latency = _latency_rows(fleet, engine, plan, settings.price_per_worker_hour or 1.0)
    rows.extend(latency)
    ratios.update(_overheads(latency))
    ratios.update(cost_ratios(latency))

    # 4: many SSE streams, ONE gateway process
    body = {**request_mix(1, plan.sse_max_tokens)[0], "priority": "default"}
    gateway_cpu0_s = fleet.cpu_seconds()["gateway"]
    gateway_pid = fleet.gateway_pids()[0]  # the one gateway process of this phase
    gateway_mb = resident_mb(gateway_pid)
    with PeakResident(gateway_pid) as gateway_peak:
        streams = asyncio.run(hold_streams(fleet.endpoint, plan.num_sse_streams, body))
    gateway_cpu_s = fleet.cpu_seconds()["gateway"] - gateway_cpu0_s
    rows.append({"phase": "sse", "system": "gateway_x1",
                 "concurrency": streams.num_streams, "peak_open": streams.peak_open,
                 "token_events": streams.num_token_events, "lost_tokens": streams.lost_tokens,
                 "out_of_order": streams.num_out_of_order, "failed_jobs": streams.num_failed,
                 "gateway_cpu_s": gateway_cpu_s, "gateway_rss_mb": gateway_mb,
                 "gateway_peak_rss_mb": gateway_peak.mb})
    ratios.update({"sse_streams": float(streams.num_streams), "sse_peak_open": float(streams.peak_open),
                   "sse_lost_tokens": float(streams.lost_tokens),
                   # what the phase's streams (and their jobs' submits) added to the gateway's resident memory
                   "sse_gateway_peak_rss_mb": gateway_peak.mb,
                   "sse_gateway_kb_per_stream": (gateway_peak.mb - gateway_mb) * 1024 / max(streams.num_streams, 1)})
    for process, source in gc_sources.items():  # the collections phases 3-4 caused in the worker and the gateway
        ratios.update(e2e_gc.during(gc_before[process], e2e_gc.scrape(*source), process))
    return engine.cfg


def _ceiling_rows(fleet: BenchFleet, plan: E2EBenchPlan, settings: ServiceSettings) -> list[dict[str, Any]]:
    """Pipelined XADD (raw RESP) and the SUBMIT script (redis-py), with Redis's own CPU per operation."""
    measures: dict[str, Callable[[], float]] = {
        "redis_xadd_pipelined": lambda: xadd_ceiling(fleet.redis_url, plan.num_ceiling_ops),
        "redis_submit_script_pipelined": lambda: submit_script_ceiling(fleet.redis_url, plan.num_ceiling_ops, settings),
    }
    rows = []
    for system, measure in measures.items():
        cpu0 = fleet.cpu_seconds()["redis"]
        rate = measure()
        redis_cpu_s = fleet.cpu_seconds()["redis"] - cpu0
        rows.append({"phase": "ceiling", "system": system, "ops_per_s": rate,
                     "redis_cpu_ms_per_job": redis_cpu_s / plan.num_ceiling_ops * 1e3})
        fleet.reset_data()
    return rows


def _submit_row(fleet: BenchFleet, plan: E2EBenchPlan) -> dict[str, Any]:
    """POST /v1/jobs at full speed, no worker running; then the queue is flushed. The clients stand in for other
    machines: on the engine's cores, idle without a worker (the gateway and Redis keep the I/O cores)."""
    with _on_engine_cpus(fleet):
        asyncio.run(submit_rate(fleet.endpoint, min(200, plan.num_submit_jobs), plan.num_submit_clients))  # warm-up
        cpu0 = fleet.cpu_seconds()
        sub = asyncio.run(submit_rate(fleet.endpoint, plan.num_submit_jobs, plan.num_submit_clients))
        cpu1 = fleet.cpu_seconds()
    fleet.reset_data()
    log.info("submit, %d gateway processes: %.0f jobs/s", fleet.num_gateway_procs, sub.jobs_per_s)
    return {
        "phase": "submit", "system": f"gateway_x{fleet.num_gateway_procs}", "concurrency": plan.num_submit_clients,
        "ops_per_s": sub.jobs_per_s, "num_jobs": sub.num_jobs,
        "client_cpu_ms_per_job": sub.client_cpu_s / sub.num_jobs * 1e3,
        "gateway_cpu_ms_per_job": (cpu1["gateway"] - cpu0["gateway"]) / sub.num_jobs * 1e3,
        "redis_cpu_ms_per_job": (cpu1["redis"] - cpu0["redis"]) / sub.num_jobs * 1e3,
    }


def _submit_ratios(rows: list[dict[str, Any]]) -> dict[str, float]:
    ceiling = {r["system"]: r for r in rows if r["phase"] == "ceiling"}
    submits = {r["system"]: r for r in rows if r["phase"] == "submit"}
    best = max(submits.values(), key=lambda r: r["ops_per_s"])
    xadd = ceiling["redis_xadd_pipelined"]["ops_per_s"]
    script = ceiling["redis_submit_script_pipelined"]["ops_per_s"]
    ratios = {
        "submit_rate_jobs_s": best["ops_per_s"],  # the best gateway setup of this run (see its row)
        "submit_gateway_procs": float(best["system"].rsplit("x", 1)[1]),
        "xadd_ceiling_ops_s": xadd,
        "submit_rate_vs_xadd_ceiling": best["ops_per_s"] / xadd,
        "submit_script_ceiling_jobs_s": script,
        "submit_rate_vs_script_ceiling": best["ops_per_s"] / script,
        "submit_client_cpu_ms_per_job": best["client_cpu_ms_per_job"],
        "submit_gateway_cpu_ms_per_job": best["gateway_cpu_ms_per_job"],
    }
    for name, row in submits.items():
        ratios[f"submit_rate_jobs_s_{name}"] = row["ops_per_s"]
    return ratios


def _engine_info(cfg: Any, plan: E2EBenchPlan) -> dict[str, Any]:
    return {
        "engine_torch_threads": plan.num_engine_threads,
        "speculative_method": cfg.speculative_method,
        "max_num_seqs": cfg.max_num_seqs,
        "native_build": str(cfg.native_build),  # the worker's (its /metrics), which the in-process engine took
        "client": "raw asyncio HTTP/1.1 keep-alive connections, one per simulated client, in the bench process",
        "fleet": "private redis-server (AOF everysec), gateway (uvicorn subprocess, access log off), one worker "
                 "subprocess; all on this machine",
        "max_tokens": plan.max_tokens,
        **{k: v for k, v in dataclasses.asdict(plan).items() if k.startswith("num_")},
    }
