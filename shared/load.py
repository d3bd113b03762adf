"""The load-test kit behind `specfleet load` (and `specfleet validate`'s latency check): open-loop Poisson
arrivals against a running fleet over HTTP, mixed priorities, streaming (SSE) and polling clients.

Open loop: request i is sent at its arrival time (exponential gaps of mean 1/rate, seeded) whether or not the
earlier ones have finished, so a slow fleet meets the same offered load instead of throttling its clients.
Each request is a job (`POST /v1/jobs`, greedy, `ignore_eos`, `max_tokens`); a streaming client follows its
SSE stream (TTFT = the first `token` event), a polling client reads the job every `poll_interval_s` (TTFT =
the first poll that shows output: coarser by up to that interval). TPOT = (end - first token) / (tokens - 1).
Goodput: requests per second that succeeded within the SLO (TTFT and TPOT under their limits).
Speaks HTTP only (httpx); imports nothing of the gateway or the workers.
"""

import asyncio
import json
import random
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from shared.schemas import Priority

DEFAULT_PROMPTS = (
    "def fibonacci(n):",
    "import os\nimport sys\n\n\ndef main():",
    "class Stack:\n    def __init__(self):",
    "# read a CSV file and print each row\nimport csv\n",
    "def is_prime(number):\n    \"\"\"Return True when number is prime.\"\"\"",
    "for i in range(10):",
)
PRIORITY_WEIGHTS = {Priority.INTERACTIVE: 0.3, Priority.DEFAULT: 0.5, Priority.BATCH: 0.2}


@dataclass
class LoadPlan:
    rate_per_s: float  # mean arrivals per second (Poisson)
    duration_s: float  # arrivals stop after this
    prompts: tuple[str, ...] = DEFAULT_PROMPTS
    max_tokens: int = 32
    stream_fraction: float = 0.5  # the rest poll
    poll_interval_s: float = 0.05
    slo_ttft_ms: float = 1000.0
    slo_tpot_ms: float = 100.0
    drain_timeout_s: float = 120.0  # after the last arrival, how long in-flight requests may still take
    seed: int = 0


@dataclass
class Outcome:
    priority: str
    client: str  # stream | poll
    ok: bool = False
    error: str | None = None  # http_<code> | <job status>:<code> | <exception name>
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None
    num_tokens: int = 0


@dataclass
class LoadReport:
    plan: dict[str, Any]
    num_sent: int
    num_ok: int
    errors: dict[str, int]
    elapsed_s: float
    requests_per_s: float
    tokens_per_s: float
    goodput_per_s: float  # requests within the SLO, per second
    percentiles_ms: dict[str, dict[str, float]]  # ttft | tpot | e2e -> p50 p90 p99
    by_client: dict[str, int] = field(default_factory=dict)
    by_priority: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100), linear between closest ranks; NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def arrival_times_s(rate_per_s: float, duration_s: float, rng: random.Random) -> list[float]:
    """Poisson arrivals: offsets from the start, exponential gaps of mean 1/rate, up to duration_s."""
    times, t = [], rng.expovariate(rate_per_s)
    while t < duration_s:
        times.append(t)
        t += rng.expovariate(rate_per_s)
    return times


async def _stream(http: httpx.AsyncClient, job_id: str, out: Outcome, sent_s: float) -> dict[str, Any] | None:
    final: dict[str, Any] | None = None
    async with http.stream("GET", f"/v1/jobs/{job_id}/stream", timeout=httpx.Timeout(10.0, read=None)) as response:
        if response.status_code >= 400:
            out.error = f"http_{response.status_code}"
            return None
        event = ""
        async for line in response.aiter_lines():
            if line.startswith("event:"):
                event = line.partition(":")[2].strip()
            elif line.startswith("data:") and event == "token" and out.ttft_ms is None:
                out.ttft_ms = (time.perf_counter() - sent_s) * 1e3
            elif line.startswith("data:") and event in ("done", "error"):
                final = json.loads(line.partition(":")[2])
                break
    return final


async def _poll(http: httpx.AsyncClient, job_id: str, out: Outcome, sent_s: float, interval_s: float) -> dict[str, Any]:
    while True:
        job = (await http.get(f"/v1/jobs/{job_id}")).json()
        if out.ttft_ms is None and (job.get("output") or {}).get("token_ids"):
            out.ttft_ms = (time.perf_counter() - sent_s) * 1e3
        if job["status"] not in ("queued", "running"):
            return dict(job)
        await asyncio.sleep(interval_s)


async def one_request(http: httpx.AsyncClient, plan: LoadPlan, out: Outcome, prompt: str) -> Outcome:
    body = {"prompt": prompt, "max_tokens": plan.max_tokens, "temperature": 0, "ignore_eos": True,
            "priority": out.priority}
    sent_s = time.perf_counter()
    try:
        response = await http.post("/v1/jobs", json=body)
        if response.status_code >= 400:
            out.error = f"http_{response.status_code}"
            return out
        job_id = response.json()["id"]
        if out.client == "stream":
            final = await _stream(http, job_id, out, sent_s)
        else:
            final = await _poll(http, job_id, out, sent_s, plan.poll_interval_s)
        if final is None:
            return out
        status = final.get("status")
        if status != "succeeded":
            out.error = f"{status}:{(final.get('error') or {}).get('code')}"
            return out
        end_s = time.perf_counter()
        out.num_tokens = int((final.get("usage") or {}).get("completion_tokens") or 0)
        out.e2e_ms = (end_s - sent_s) * 1e3
        if out.ttft_ms is not None and out.num_tokens > 1:
            out.tpot_ms = (out.e2e_ms - out.ttft_ms) / (out.num_tokens - 1)
        out.ok = True
    except (httpx.HTTPError, ValueError, KeyError) as exc:
        out.error = type(exc).__name__
    return out


async def run_load(url: str, api_key: str | None, plan: LoadPlan) -> LoadReport:
    """Offer the plan's load to the fleet at `url`; wait for every request (or drain_timeout_s)."""
    rng = random.Random(plan.seed)
    arrivals = arrival_times_s(plan.rate_per_s, plan.duration_s, rng)
    priorities, weights = list(PRIORITY_WEIGHTS), list(PRIORITY_WEIGHTS.values())
    outcomes = [
        Outcome(priority=rng.choices(priorities, weights)[0].value,
                client="stream" if rng.random() < plan.stream_fraction else "poll")
        for _ in arrivals
    ]
    prompts = [plan.prompts[i % len(plan.prompts)] for i in range(len(arrivals))]
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=30.0, limits=limits) as http:
        start_s = time.perf_counter()
        tasks = []
        for offset_s, out, prompt in zip(arrivals, outcomes, prompts, strict=True):
            await asyncio.sleep(max(0.0, start_s + offset_s - time.perf_counter()))
            tasks.append(asyncio.create_task(one_request(http, plan, out, prompt)))
        if tasks:
            done, pending = await asyncio.wait(tasks, timeout=plan.drain_timeout_s)
            for task in pending:
                task.cancel()
            for out in outcomes:
                if out.e2e_ms is None and out.error is None and not out.ok:
                    out.error = "drain_timeout"
        elapsed_s = time.perf_counter() - start_s
    return summarize(plan, outcomes, elapsed_s)


def summarize(plan: LoadPlan, outcomes: list[Outcome], elapsed_s: float) -> LoadReport:
    ok = [o for o in outcomes if o.ok]
    errors: dict[str, int] = {}
    for o in outcomes:
        if o.error:
            errors[o.error] = errors.get(o.error, 0) + 1
    series = {
        "ttft": [o.ttft_ms for o in ok if o.ttft_ms is not None],
        "tpot": [o.tpot_ms for o in ok if o.tpot_ms is not None],
        "e2e": [o.e2e_ms for o in ok if o.e2e_ms is not None],
    }
    within_slo = [
        o for o in ok
        if o.ttft_ms is not None and o.ttft_ms <= plan.slo_ttft_ms and (o.tpot_ms or 0.0) <= plan.slo_tpot_ms
    ]
    elapsed = max(elapsed_s, 1e-9)
    return LoadReport(
        plan={k: v for k, v in asdict(plan).items() if k != "prompts"} | {"num_prompts": len(plan.prompts)},
        num_sent=len(outcomes),
        num_ok=len(ok),
        errors=errors,
        elapsed_s=round(elapsed_s, 3),
        requests_per_s=len(ok) / elapsed,
        tokens_per_s=sum(o.num_tokens for o in ok) / elapsed,
        goodput_per_s=len(within_slo) / elapsed,
        percentiles_ms={
            name: {f"p{q}": percentile(values, q) for q in (50, 90, 99)} for name, values in series.items()
        },
        by_client={kind: sum(o.client == kind for o in outcomes) for kind in ("stream", "poll")},
        by_priority={p.value: sum(o.priority == p.value for o in outcomes) for p in Priority},
    )

