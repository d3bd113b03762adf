"""The worker's Prometheus metrics (DESIGN.md "Metrics"), served on `/metrics` at settings.worker_metrics_port.

Updated by the worker's thread after its engine steps, from what the engine already counts: batch size, KV
blocks, waiting/running sequences, tokens generated, TTFT and time per output token of finished jobs, the
speculation figures of `engine.speculator.stats`, and what each model compiled (`engine.compile_stats`: graphs
in use per shape bucket, start-up compile seconds, compilations or compiled forwards that failed and fell back
to eager); plus the jobs this worker finished, by outcome.

Execution deadlines (a job stopped because it ran past its deadline) are counted here too; the worker code
that enforces deadlines calls `job_finished(JobOutcome.DEADLINE_EXCEEDED)`:
    specfleet_jobs_deadline_exceeded_total   counter, no labels: +1 each time a job is stopped at its deadline
    specfleet_jobs_deadline_exceeded_streak  gauge: jobs in a row this worker stopped at their deadline; back to
                                              0 when a job finishes any other way (the "5 timeouts in a row" alert)

Cost: `specfleet_worker_compute_seconds_total` (engine seconds charged to jobs) and
`specfleet_worker_cost_total` (those seconds at settings.price_per_worker_hour), one `job_cost` per job.

The speculation figures are copied into a small snapshot (the HTTP thread never reads the engine's live
dicts) and rendered at scrape time by a collector.

Refreshes: the gauges, the generated-token counter and the snapshots are brought up to date at most every
REFRESH_INTERVAL_S while steps run, and at once on a step that finished a job or produced nothing (the
engine idle), so a scrape after a job ended sees it whole. Refreshing all of it after every step cost ~30-50
us, right after a step had left the caches cold: ~4 % of a one-sequence decode step of the demo target
(2026-12-04).
"""

import enum
import logging
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    start_http_server,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from shared.gc_pauses import GcMetrics
from workers.engine.outputs import StepOutput
from workers.worker.loop_time import LoopClock
from workers.worker.priority_metrics import PriorityMetrics

log = logging.getLogger(__name__)

TTFT_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
TPOT_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
REFRESH_INTERVAL_S = 0.25  # while steps run, the gauges and snapshots are at most this old


class JobOutcome(enum.StrEnum):
    """The `outcome` label of specfleet_worker_jobs_finished_total."""

    SUCCEEDED = "succeeded"  # the engine finished it (stop, length, EOS)
    FAILED = "failed"  # refused or failed by the engine
    DEADLINE_EXCEEDED = "deadline_exceeded"  # stopped at its execution deadline


@dataclass
class SpecSnapshot:
    """engine.speculator.stats as of the last step."""

    num_steps: int = 0
    num_drafted: int = 0
    num_accepted: int = 0
    num_emitted: int = 0
    per_position_acceptance: list[float] = field(default_factory=list)  # [draft position] accepted / verified
    accepted_length_histogram: dict[int, int] = field(default_factory=dict)  # accepted per seq-step -> count
    num_fallbacks: int = 0
    num_vetoed_steps: int = 0
    draft_time_s: float = 0.0
    verify_time_s: float = 0.0
    # method ("draft", "ngram", "eagle") -> its own figures: (steps, drafted, accepted, rejected, emitted,
    # draft s, acceptance per draft position)
    by_method: dict[str, tuple[int, int, int, int, int, float, list[float]]] = field(default_factory=dict)

    @classmethod
    def of(cls, stats: Any) -> "SpecSnapshot":
        counts = stats.counts
        by_method = {
            str(method): (m.counts.num_steps, m.counts.num_drafted, m.counts.num_accepted, m.counts.num_rejected,
                          m.counts.num_emitted, m.draft_time_s, list(m.counts.per_position_acceptance()))
            for method, m in getattr(stats, "methods", {}).items()
        }  # fmt: skip
        return cls(
            by_method=by_method,
            num_steps=counts.num_steps,
            num_drafted=counts.num_drafted,
            num_accepted=counts.num_accepted,
            num_emitted=counts.num_emitted,
            per_position_acceptance=list(counts.per_position_acceptance()),
            accepted_length_histogram=dict(stats.accepted_length_histogram),
            num_fallbacks=stats.num_fallbacks,
            num_vetoed_steps=stats.num_vetoed_steps,
            draft_time_s=stats.draft_time_s,
            verify_time_s=stats.verify_time_s,
        )


class SpecCollector(Collector):
    def __init__(self) -> None:
        self.snapshot = SpecSnapshot()

    def collect(self) -> Iterable[Metric]:
        s = self.snapshot  # one reference: replaced whole by the worker thread, never mutated
        for name, doc, value in (
            ("specfleet_spec_steps", "Verification steps that carried draft tokens", s.num_steps),
            ("specfleet_spec_draft_tokens", "Draft tokens proposed", s.num_drafted),
            ("specfleet_spec_accepted_tokens", "Draft tokens accepted", s.num_accepted),
            ("specfleet_spec_emitted_tokens", "Tokens emitted by speculative steps", s.num_emitted),
            ("specfleet_spec_fallbacks", "Sequences that fell back to plain decoding", s.num_fallbacks),
            ("specfleet_spec_vetoed_steps", "Steps decoded plainly where speculative steps had delivered fewer "
             "tokens per second than plain ones", s.num_vetoed_steps),
            ("specfleet_spec_draft_seconds", "Time spent drafting", s.draft_time_s),
            ("specfleet_spec_verify_seconds", "Target forward + verification time of speculative steps",
             s.verify_time_s),
        ):
            yield CounterMetricFamily(name, doc, value=value)
        per_position = GaugeMetricFamily(
            "specfleet_spec_acceptance_rate", "Acceptance rate per draft position (0 = first)", labels=["position"]
        )
        for position, rate in enumerate(s.per_position_acceptance):
            per_position.add_metric([str(position)], rate)
        yield per_position
        yield _accepted_length_histogram(s.accepted_length_histogram)
        yield from _by_method(s.by_method)


def _by_method(by_method: dict[str, tuple[int, int, int, int, int, float, list[float]]]) -> Iterable[Metric]:
    """The speculation figures again, labelled by method (draft, ngram, eagle)."""
    families = [
        CounterMetricFamily("specfleet_spec_method_steps", "Verification steps that carried draft tokens",
                            labels=["method"]),
        CounterMetricFamily("specfleet_spec_method_draft_tokens", "Draft tokens proposed", labels=["method"]),
        CounterMetricFamily("specfleet_spec_method_accepted_tokens", "Draft tokens accepted", labels=["method"]),
        CounterMetricFamily("specfleet_spec_method_rejected_tokens",
                            "Draft tokens the target judged and rejected (at most one per path)", labels=["method"]),
        CounterMetricFamily("specfleet_spec_method_emitted_tokens", "Tokens emitted by speculative steps",
                            labels=["method"]),
        CounterMetricFamily("specfleet_spec_method_draft_seconds", "Time its proposer spent", labels=["method"]),
    ]  # fmt: skip
    tau = GaugeMetricFamily("specfleet_spec_method_mean_accepted_tokens", "Tokens per target pass (tau)",
                            labels=["method"])  # fmt: skip
    per_position = GaugeMetricFamily("specfleet_spec_method_acceptance_rate", "Acceptance rate per draft position",
                                     labels=["method", "position"])  # fmt: skip
    rejection = GaugeMetricFamily("specfleet_spec_method_rejection_rate",
                                  "Of the draft tokens the target judged, the share it rejected (1 - alpha)",
                                  labels=["method"])  # fmt: skip
    for method, (steps, drafted, accepted, rejected, emitted, draft_s, rates) in sorted(by_method.items()):
        for family, value in zip(families, (steps, drafted, accepted, rejected, emitted, draft_s), strict=True):
            family.add_metric([method], value)
        tau.add_metric([method], emitted / steps if steps else 1.0)
        rejection.add_metric([method], rejected / (accepted + rejected) if accepted + rejected else 0.0)
        for position, rate in enumerate(rates):
            per_position.add_metric([method, str(position)], rate)
    yield from families
    yield tau
    yield rejection
    yield per_position


def _accepted_length_histogram(counts: dict[int, int]) -> HistogramMetricFamily:
    """Draft tokens accepted per sequence-step, one bucket per length (le=0, 1, 2, ...)."""
    buckets: list[tuple[str, float]] = []
    cumulative = 0
    for length in range(max(counts, default=0) + 1):
        cumulative += counts.get(length, 0)
        buckets.append((str(length), cumulative))
    buckets.append(("+Inf", cumulative))
    total = sum(length * n for length, n in counts.items())
    return HistogramMetricFamily(
        "specfleet_spec_accepted_length", "Draft tokens accepted per sequence-step", buckets=buckets,
        sum_value=total,
    )


@dataclass(frozen=True)
class CompileSnapshot:
    """engine.compile_stats as of the last change: model ("target", "draft") -> its figures."""

    is_compiled: dict[tuple[str, str], bool] = field(default_factory=dict)  # (model, bucket) -> compiled graph in use
    compile_time_s: dict[str, float] = field(default_factory=dict)  # model -> start-up compile seconds
    num_failures: dict[str, int] = field(default_factory=dict)  # model -> fell back to eager
    is_native_attention: dict[str, bool] = field(default_factory=dict)  # model -> the native kernel attends
    is_packed: dict[str, bool] = field(default_factory=dict)  # model -> its linear weights are prepacked
    fused_max_tokens: dict[str, int] = field(default_factory=dict)  # model -> its native layers' largest pass
    small_pass_threads: dict[str, int] = field(default_factory=dict)  # model -> threads of its small passes
    graph_capture_s: dict[str, float] = field(default_factory=dict)  # model -> its decode graphs' capture seconds
    native_build: str = ""  # the native kernels' build (workers/engine/native_build.py)

    @classmethod
    def of(
        cls,
        compile_stats: dict[str, Any],
        native_attention: dict[str, bool],
        packing: dict[str, Any],
        fusing: dict[str, Any],
        graph_capture_s: dict[str, float],
        small_pass_threads: dict[str, Any],
        native_build: str = "",
    ) -> "CompileSnapshot":
        return cls(
            is_compiled={(m, b): on for m, st in compile_stats.items() for b, on in st.is_compiled.items()},
            compile_time_s={m: st.compile_time_s for m, st in compile_stats.items()},
            num_failures={m: st.num_failures for m, st in compile_stats.items()},
            is_native_attention=dict(native_attention),
            is_packed={m: st.is_packed for m, st in packing.items()},
            fused_max_tokens={m: st.max_tokens for m, st in fusing.items()},
            small_pass_threads={m: choice.num_threads for m, choice in small_pass_threads.items()},
            graph_capture_s=dict(graph_capture_s),
            native_build=native_build,
        )


class CompileCollector(Collector):
    def __init__(self) -> None:
        self.snapshot = CompileSnapshot()

    def collect(self) -> Iterable[Metric]:
        s = self.snapshot  # replaced whole by the worker thread, never mutated
        compiled = GaugeMetricFamily(
            "specfleet_engine_compiled", "1 where a compiled graph serves the model's passes of this shape bucket",
            labels=["model", "bucket"],
        )
        for (model, bucket), on in s.is_compiled.items():
            compiled.add_metric([model, bucket], float(on))
        yield compiled
        yield _gauge_per_model(
            "specfleet_engine_fused_max_tokens",
            "The model's passes of at most this many tokens run its decoder layers as one native call (0: none)",
            s.fused_max_tokens,
        )
        yield _gauge_per_model(
            "specfleet_engine_small_pass_threads",
            "Threads of the model's passes of at most single_thread_max_tokens tokens (EngineConfig.small_pass_threads)",
            s.small_pass_threads,
        )
        seconds = GaugeMetricFamily("specfleet_engine_compile_seconds", "Start-up compilation time", labels=["model"])
        failures = CounterMetricFamily(
            "specfleet_engine_compile_failures", "Compilations or compiled forwards that failed (now eager)",
            labels=["model"],
        )
        for model, value in s.compile_time_s.items():
            seconds.add_metric([model], value)
        for model, count in s.num_failures.items():
            failures.add_metric([model], count)
        yield seconds
        yield failures
        yield _flag_per_model(
            "specfleet_engine_native_attention",
            "1 where the native attention kernel serves the model (0: SDPA, e.g. no C++ compiler at start-up)",
            s.is_native_attention,
        )
        yield _flag_per_model(
            "specfleet_engine_packed_linears",
            "1 where the model's linear weights are prepacked for oneDNN (EngineConfig.linear_packing)",
            s.is_packed,
        )
        build = GaugeMetricFamily(
            "specfleet_engine_native_build",
            "1 for the build the native kernels come from (EngineConfig.native_build: host or portable)",
            labels=["build"],
        )
        if s.native_build:
            build.add_metric([s.native_build], 1.0)
        yield build
        yield _gauge_per_model(
            "specfleet_engine_cuda_graph_capture_seconds",
            "Start-up capture time of the model's decode graphs (present where they serve its decode passes)",
            s.graph_capture_s,
        )


def native_build_of(engine: Any) -> str:
    """The build the engine's native kernels come from ('' where it has none)."""
    return engine.native_build.build.value if engine.native_build is not None else ""


def _gauge_per_model(name: str, documentation: str, values: Mapping[str, float]) -> GaugeMetricFamily:
    gauge = GaugeMetricFamily(name, documentation, labels=["model"])
    for model, value in values.items():
        gauge.add_metric([model], value)
    return gauge


def _flag_per_model(name: str, documentation: str, flags: dict[str, bool]) -> GaugeMetricFamily:
    return _gauge_per_model(name, documentation, {model: float(on) for model, on in flags.items()})


class EngineMetrics:
    """One per worker process; `update(engine, outputs)` after each engine step, `serve(host, port)` once."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        ProcessCollector(registry=r)  # process_resident_memory_bytes, CPU seconds, open fds
        self.batch_size = Gauge("specfleet_engine_batch_size", "Sequences advanced by the last step", registry=r)
        self.kv_blocks_used = Gauge("specfleet_engine_kv_blocks_used", "KV cache blocks in use", registry=r)
        self.kv_blocks_free = Gauge("specfleet_engine_kv_blocks_free", "KV cache blocks free", registry=r)
        self.prefix_queried = Counter("specfleet_engine_prefix_cache_queried_tokens",
                                      "Tokens of admitted sequences looked up in the prefix cache", registry=r)
        self.prefix_hits = Counter("specfleet_engine_prefix_cache_hit_tokens",
                                   "Of those, tokens taken from cached blocks instead of computed", registry=r)
        self._prefix_seen = (0, 0)  # the cache's (queried, hit) tokens at the last refresh
        self.waiting = Gauge("specfleet_engine_waiting_seqs", "Sequences waiting to start", registry=r)
        self.running = Gauge("specfleet_engine_running_seqs", "Sequences running", registry=r)
        self.ttft = Histogram("specfleet_engine_ttft_seconds", "Time to first token of finished requests",
                              buckets=TTFT_BUCKETS_S, registry=r)
        self.tpot = Histogram("specfleet_engine_time_per_output_token_seconds",
                              "Decode time per output token of finished requests", buckets=TPOT_BUCKETS_S,
                              registry=r)
        self.generated_tokens = Counter("specfleet_engine_generated_tokens", "Tokens generated (all jobs)",
                                        registry=r)
        self.jobs_finished = Counter("specfleet_worker_jobs_finished", "Jobs this worker finished, by outcome",
                                     ["outcome"], registry=r)
        for outcome in JobOutcome:
            self.jobs_finished.labels(outcome.value)  # every outcome exported from the start (0)
        self.deadline_exceeded = Counter("specfleet_jobs_deadline_exceeded",
                                         "Jobs stopped because they ran past their execution deadline", registry=r)
        self.deadline_streak = Gauge("specfleet_jobs_deadline_exceeded_streak",
                                     "Jobs in a row this worker stopped at their deadline (0 after any other end)",
                                     registry=r)
        self.compute_seconds = Counter("specfleet_worker_compute_seconds",
                                       "Engine seconds charged to finished jobs (workers/worker/cost.py)", registry=r)
        self.cost = Counter("specfleet_worker_cost", "Cost of finished jobs at price_per_worker_hour", registry=r)
        self.gc = GcMetrics.create(r)  # the worker process's collector (observed by `specfleet worker`)
        self.token_events = Counter("specfleet_worker_token_events",
                                    "Token events written to jobs' streams, one or more tokens each (a stream "
                                    "interval and the writer's merged batches make them fewer)", registry=r)
        self._num_token_events_seen = 0
        self.pulled_jobs = Counter("specfleet_worker_pulled_jobs",
                                   "Jobs this worker took off the queues, by what pulled them: the loop at a "
                                   "boundary or its idle wait (loop), or the thread that pulls while the engine "
                                   "steps (puller: workers/worker/puller.py)", ["by"], registry=r)  # fmt: skip
        for by in ("loop", "puller"):
            self.pulled_jobs.labels(by)  # both exported from the start (0)
        self.spec = SpecCollector()
        r.register(self.spec)
        self.compile = CompileCollector()
        r.register(self.compile)
        self.priorities = PriorityMetrics(r)  # preemptions, queue wait and TTFT by queue priority
        self.loop_clock = LoopClock()  # the worker loop's time by part, read at scrape time (loop_time.py)
        r.register(self.loop_clock)
        self._num_spec_steps_seen = -1
        self._num_new_tokens = 0  # generated since the last refresh
        self._next_refresh_s = 0.0  # time.monotonic() of the next refresh while steps run

    def update(self, engine: Any, outputs: list[StepOutput]) -> None:
        """After an engine step: count its tokens; refresh the rest when due (the module's docstring). A refresh
        is a few gauge sets, one observation per finished request, and a snapshot copy only when the
        speculation counters moved."""
        self._num_new_tokens += sum(len(out.new_token_ids) for out in outputs)
        now_s = time.monotonic()
        has_finished = any(out.finished for out in outputs)
        if outputs and not has_finished and now_s < self._next_refresh_s:
            return
        self._next_refresh_s = now_s + REFRESH_INTERVAL_S
        self.batch_size.set(len(outputs))
        blocks = engine.block_manager
        self.kv_blocks_free.set(blocks.num_free_blocks)
        self.kv_blocks_used.set(blocks.num_blocks - blocks.num_free_blocks)
        if blocks.cache is not None:
            queried, hit = blocks.cache.num_queried_tokens, blocks.cache.num_hit_tokens
            self.prefix_queried.inc(queried - self._prefix_seen[0])
            self.prefix_hits.inc(hit - self._prefix_seen[1])
            self._prefix_seen = (queried, hit)
        self.waiting.set(len(engine.scheduler.waiting))
        self.running.set(len(engine.scheduler.running))
        self.generated_tokens.inc(self._num_new_tokens)
        self._num_new_tokens = 0
        for out in _finished(outputs):
            self.job_finished(JobOutcome.SUCCEEDED)
            if "ttft_ms" in out.metrics:
                self.ttft.observe(out.metrics["ttft_ms"] / 1e3)
            if out.metrics.get("tokens_per_s", 0.0) > 0:
                self.tpot.observe(1.0 / out.metrics["tokens_per_s"])
        stats = engine.speculator.stats
        seen = self.spec.snapshot
        if (
            stats.counts.num_steps != self._num_spec_steps_seen
            or stats.num_fallbacks != seen.num_fallbacks
            or stats.num_vetoed_steps != seen.num_vetoed_steps
        ):
            self._num_spec_steps_seen = stats.counts.num_steps
            self.spec.snapshot = SpecSnapshot.of(stats)
        compile_now = CompileSnapshot.of(  # a few entries: cheap
            engine.compile_stats, engine.native_attention, engine.packing, engine.fusing, engine.graph_capture_s,
            engine.small_pass_threads, native_build_of(engine),
        )
        if compile_now != self.compile.snapshot:
            self.compile.snapshot = compile_now

    def job_finished(self, outcome: JobOutcome) -> None:
        """One job ended on this worker (successes are counted by `update`)."""
        self.jobs_finished.labels(outcome.value).inc()
        if outcome is JobOutcome.DEADLINE_EXCEEDED:
            self.deadline_exceeded.inc()
            self.deadline_streak.inc()
        else:
            self.deadline_streak.set(0)

    def jobs_pulled(self, by: str, num_jobs: int) -> None:
        """`num_jobs` jobs started by a pull of the loop's (`loop`) or of its puller thread (`puller`)."""
        if num_jobs:
            self.pulled_jobs.labels(by).inc(num_jobs)

    def token_events_written(self, total: int) -> None:
        """The writer's count of token events so far (StepWriter.num_token_events)."""
        if total > self._num_token_events_seen:
            self.token_events.inc(total - self._num_token_events_seen)
            self._num_token_events_seen = total

    def job_cost(self, compute_s: float, cost: float) -> None:
        """One job's engine time and its price (workers/worker/cost.py), whatever its outcome."""
        self.compute_seconds.inc(compute_s)
        self.cost.inc(cost)

    def serve(self, host: str, port: int) -> int:
        """Serve /metrics in a background thread; returns the port (useful with port 0)."""
        server, _ = start_http_server(port, addr=host, registry=self.registry)
        bound = int(server.server_port)
        log.info("worker metrics at http://%s:%d/metrics", host, bound)
        return bound


def _finished(outputs: list[StepOutput]) -> Iterator[StepOutput]:
    return (out for out in outputs if out.finished)
