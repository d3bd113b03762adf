"""The `mixed` phase of `specfleet bench e2e` (issue 18): one worker, a saturating batch backlog, interactive
requests arriving at a steady rate; and two tenants' batches through /v1/batches.

1. idle: interactive requests alone at the steady rate (POST -> first SSE token, client clock), after one that
   is not counted (a worker's first job runs with its caches cold).
2. batch alone: a backlog of batch-priority jobs, submitted at once; batch tokens/s = their tokens over the time
   from the first submit to the last one's end. The backlog is sized from a first one of num_batch_jobs (not
   reported) to last min_interactive_under_batch arrivals of phase 3 at the batch rate measured here, now:
   a fixed count lasted one arrival at 2 s once the engine ran ~1,900 tokens/s, and phase 3's p99 was one TTFT.
3. mixed: the same backlog, with the interactive requests arriving at the same rate for as long as it lasts.
4. fairness: two API keys each submit a batch file, the second right after the first (Celery expands them under
   the per-key quota); their completed lines are sampled until both are done.

Ratios: `mixed_interactive_ttft_p99_vs_idle` (3 over 1, goal <= 1.5), `mixed_batch_throughput_vs_alone` (3 over
2, goal >= 0.9), `mixed_batch_preemptions` (batch sequences preempted in 1-3, from the worker's /metrics), and
`fairness_second_vs_first_at_half` (the second tenant's completed lines over the first's when the first had
half of its lines done; 1 = in step) with `fairness_min_ratio` (the lowest such ratio once both had lines
done). Everything shares this machine's cores: read the ratios, within one run.
"""

import asyncio
import json
import logging
import math
import time
from dataclasses import dataclass
from typing import Any

from shared.schemas import EventType
from workers.bench.e2e_latency import PROMPTS, percentile_ms
from workers.bench.http_client import Endpoint, metric_samples

log = logging.getLogger(__name__)

POLL_S = 0.25
TERMINAL = ("succeeded", "failed", "cancelled", "expired")


@dataclass(frozen=True)
class MixedPlan:
    max_num_seqs: int = 4  # the worker's slots in this phase (the scenario)
    num_batch_jobs: int = 24
    batch_max_tokens: int = 256
    interactive_max_tokens: int = 16
    interactive_interval_s: float = 2.0  # one interactive request every this many seconds
    num_idle_interactive: int = 10
    min_interactive_under_batch: int = 10  # the backlog lasts this many arrivals (at the sizing run's batch rate)
    fairness_lines: int = 48  # per tenant
    fairness_max_tokens: int = 16
    fairness_inflight_lines_per_key: int = 8  # the quota the bench's fleet runs with (FLEET_ENV)

    @classmethod
    def quick(cls) -> "MixedPlan":
        return cls(num_batch_jobs=12, batch_max_tokens=128, num_idle_interactive=8, min_interactive_under_batch=6,
                   fairness_lines=32)

    @classmethod
    def tiny(cls) -> "MixedPlan":
        return cls(num_batch_jobs=4, batch_max_tokens=16, interactive_max_tokens=4, interactive_interval_s=0.2,
                   num_idle_interactive=2, min_interactive_under_batch=2, fairness_lines=6, fairness_max_tokens=2,
                   fairness_inflight_lines_per_key=2)  # fmt: skip


def _body(prompt: str, max_tokens: int, priority: str) -> dict[str, Any]:
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "priority": priority}


async def _interactive(endpoint: Endpoint, index: int, plan: MixedPlan) -> float:
    """One interactive request on its own connection -> its TTFT (s): POST sent -> first token event read."""
    conn = await endpoint.connect()
    try:
        start = time.perf_counter()
        body = _body(PROMPTS[index % len(PROMPTS)], plan.interactive_max_tokens, "interactive")
        status, raw = await conn.request(endpoint.post("/v1/jobs", body))
        if status != 202:
            raise RuntimeError(f"submit answered {status}: {raw[:200]!r}")
        job_id = json.loads(raw)["id"]
        first = 0.0
        async for frame in conn.sse(endpoint.get(f"/v1/jobs/{job_id}/stream")):
            if frame.event == EventType.TOKEN.value:
                first = first or time.perf_counter()
            elif frame.event == EventType.ERROR.value:
                raise RuntimeError(f"job {job_id} failed: {frame.data}")
        return first - start
    finally:
        await conn.close()


async def _trickle(endpoint: Endpoint, plan: MixedPlan, until: asyncio.Event | None, count: int = 0) -> list[float]:
    """Interactive requests every interactive_interval_s: `count` of them, or until `until` is set."""
    tasks: list[asyncio.Task[float]] = []
    while (until is None and len(tasks) < count) or (until is not None and not until.is_set()):
        tasks.append(asyncio.create_task(_interactive(endpoint, len(tasks), plan)))
        try:
            await asyncio.wait_for((until or asyncio.Event()).wait(), plan.interactive_interval_s)
        except TimeoutError:
            pass
    return list(await asyncio.gather(*tasks))


def sized_backlog(plan: MixedPlan, tokens_per_s: float) -> int:
    """Batch jobs that last min_interactive_under_batch interactive arrivals at `tokens_per_s` (at least the
    plan's num_batch_jobs)."""
    wanted_tokens = tokens_per_s * plan.interactive_interval_s * plan.min_interactive_under_batch
    return max(plan.num_batch_jobs, math.ceil(wanted_tokens / plan.batch_max_tokens))


async def _backlog(
    endpoint: Endpoint,
    plan: MixedPlan,
    num_jobs: int,
    submitted: asyncio.Event | None = None,
    done: asyncio.Event | None = None,
) -> tuple[int, float]:
    """Submit a backlog of num_jobs batch jobs at once, poll until every job ended -> (tokens generated,
    seconds); `submitted` and `done` are set on the way. A poll reads the jobs in their order and stops at the
    first one still running (the worker's max_num_seqs slots run them about in order; the backlog's end is seen
    a poll late at most)."""
    conn = await endpoint.connect()
    try:
        start = time.perf_counter()
        job_ids = []
        for i in range(num_jobs):
            body = _body(PROMPTS[i % len(PROMPTS)], plan.batch_max_tokens, "batch")
            status, raw = await conn.request(endpoint.post("/v1/jobs", body))
            if status != 202:
                raise RuntimeError(f"submit answered {status}: {raw[:200]!r}")
            job_ids.append(json.loads(raw)["id"])
        if submitted is not None:
            submitted.set()
        num_tokens, pending = 0, list(job_ids)
        while pending:
            await asyncio.sleep(POLL_S)
            for job_id in list(pending):
                _, raw = await conn.request(endpoint.get(f"/v1/jobs/{job_id}"))
                job = json.loads(raw)
                if job["status"] not in TERMINAL:
                    break
                if job["status"] != "succeeded":
                    raise RuntimeError(f"batch job {job_id} ended {job['status']}: {job.get('error')}")
                num_tokens += int(job["usage"]["completion_tokens"])
                pending.remove(job_id)
        return num_tokens, time.perf_counter() - start
    finally:
        if done is not None:
            done.set()
        await conn.close()


async def _mixed(endpoint: Endpoint, plan: MixedPlan, num_jobs: int) -> tuple[tuple[int, float], list[float]]:
    submitted, done = asyncio.Event(), asyncio.Event()
    backlog = asyncio.create_task(_backlog(endpoint, plan, num_jobs, submitted, done))
    await submitted.wait()  # the backlog is queued (the worker's slots fill with it): the trickle starts
    ttfts = await _trickle(endpoint, plan, done)
    return await backlog, ttfts


def run_mixed(endpoint: Endpoint, plan: MixedPlan) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """Phases 1-3 against a fleet whose one worker runs with plan.max_num_seqs slots."""
    asyncio.run(_interactive(endpoint, 0, plan))  # the worker's first job: not counted
    idle = asyncio.run(_trickle(endpoint, plan, None, plan.num_idle_interactive))
    sizing_tokens, sizing_s = asyncio.run(_backlog(endpoint, plan, plan.num_batch_jobs))
    sizing_tokens_per_s = sizing_tokens / sizing_s
    num_jobs = sized_backlog(plan, sizing_tokens_per_s)
    log.info("mixed: a backlog of %d batch jobs (%.0f tokens/s over %d)", num_jobs, sizing_tokens_per_s,
             plan.num_batch_jobs)
    alone_tokens, alone_s = asyncio.run(_backlog(endpoint, plan, num_jobs))
    (mixed_tokens, mixed_s), mixed_ttfts = asyncio.run(_mixed(endpoint, plan, num_jobs))
    rows: list[dict[str, Any]] = [
        {"phase": "mixed", "system": "interactive_idle", "num_requests": len(idle),
         "ttft_ms_p50": percentile_ms(idle, 50), "ttft_ms_p99": percentile_ms(idle, 99)},
        {"phase": "mixed", "system": "batch_alone", "num_requests": num_jobs,
         "tokens_per_s": alone_tokens / alone_s, "seconds": alone_s},
        {"phase": "mixed", "system": "interactive_under_batch", "num_requests": len(mixed_ttfts),
         "ttft_ms_p50": percentile_ms(mixed_ttfts, 50), "ttft_ms_p99": percentile_ms(mixed_ttfts, 99)},
        {"phase": "mixed", "system": "batch_under_interactive", "num_requests": num_jobs,
         "tokens_per_s": mixed_tokens / mixed_s, "seconds": mixed_s},
    ]  # fmt: skip
    ratios = {
        "mixed_interactive_ttft_p99_vs_idle": rows[2]["ttft_ms_p99"] / rows[0]["ttft_ms_p99"],
        "mixed_interactive_ttft_p50_vs_idle": rows[2]["ttft_ms_p50"] / rows[0]["ttft_ms_p50"],
        "mixed_batch_throughput_vs_alone": rows[3]["tokens_per_s"] / rows[1]["tokens_per_s"],
    }
    log.info("mixed: %s", ratios)
    return rows, ratios


def preemptions(metrics_port: int) -> float:
    """specfleet_preemptions_total{priority="batch"} from the worker's /metrics (0 when absent)."""
    for sample in metric_samples(f"http://127.0.0.1:{metrics_port}/metrics"):
        if sample.name == "specfleet_preemptions_total" and sample.labels.get("priority") == "batch":
            return float(sample.value)
    return 0.0


def _batch_file(num_lines: int, max_tokens: int, tenant: str) -> bytes:
    lines = [
        {"custom_id": f"{tenant}-{i}", "method": "POST", "url": "/v1/jobs",
         "body": {"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": max_tokens, "temperature": 0,
                  "ignore_eos": True}}
        for i in range(num_lines)
    ]  # fmt: skip
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


def _post_file(endpoint: Endpoint, data: bytes) -> bytes:
    head = f"POST /v1/batches HTTP/1.1\r\nHost: {endpoint.host}:{endpoint.port}\r\n"
    head += "".join(f"{k}: {v}\r\n" for k, v in endpoint.headers)
    head += f"Content-Type: application/jsonl\r\nContent-Length: {len(data)}\r\n\r\n"
    return head.encode() + data


Sample = tuple[float, int, int]  # (seconds since the submits, first tenant's completed lines, second's)


async def _fairness(tenants: list[Endpoint], plan: MixedPlan) -> list[Sample]:
    """Each tenant posts its batch file (the second right after the first) -> samples (s, first's completed
    lines, second's) until both batches ended."""
    conns = [await t.connect() for t in tenants]
    try:
        batch_ids = []
        for tenant, conn, name in zip(tenants, conns, ("first", "second"), strict=True):
            status, raw = await conn.request(_post_file(tenant, _batch_file(plan.fairness_lines, plan.fairness_max_tokens, name)))
            if status != 202:
                raise RuntimeError(f"batch submit answered {status}: {raw[:200]!r}")
            batch_ids.append(json.loads(raw)["id"])
        start, samples = time.perf_counter(), list[Sample]()
        while True:
            await asyncio.sleep(POLL_S)
            batches = []
            for tenant, conn, batch_id in zip(tenants, conns, batch_ids, strict=True):
                _, raw = await conn.request(tenant.get(f"/v1/batches/{batch_id}"))
                batches.append(json.loads(raw))
            first, second = (int(b["request_counts"]["completed"]) for b in batches)
            samples.append((time.perf_counter() - start, first, second))
            if all(b["status"] in ("completed", "failed", "expired", "cancelled") for b in batches):
                return samples
    finally:
        for conn in conns:
            await conn.close()


def run_fairness(tenants: list[Endpoint], plan: MixedPlan) -> tuple[list[dict[str, Any]], dict[str, float]]:
    samples = asyncio.run(_fairness(tenants, plan))
    half = plan.fairness_lines // 2
    at_half = next((second for _, first, second in samples if first >= half), 0)
    both = [b / a for _, a, b in samples if 0 < a < plan.fairness_lines and b > 0]
    rows = [{"phase": "fairness", "system": "two_tenants", "seconds": s, "first_completed": a,
             "second_completed": b} for s, a, b in samples]  # fmt: skip
    ratios = {
        "fairness_second_vs_first_at_half": at_half / half,
        "fairness_min_ratio": min(both, default=0.0),
        "fairness_lines_per_tenant": float(plan.fairness_lines),
    }
    log.info("fairness: %s", ratios)
    return rows, ratios
