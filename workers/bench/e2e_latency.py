"""TTFT and time per output token of one request mix, two ways:

- fleet: N closed-loop clients, each POSTs /v1/jobs, opens the job's SSE stream and reads it to the end, then
  sends its next request. TTFT = POST sent -> first token event read (client clock); TPOT = (last token event
  - first token event) / (tokens - 1).
- engine: the same N closed-loop "clients" straight into an in-process Engine (no Redis, no HTTP): a client's
  next request is added in the step its previous one finished. TTFT = add_request -> the step output carrying
  its first token; TPOT likewise. With a gap (`run_engine(gap_s=...)`), a client's next request comes that long
  after its previous one finished, the engine asleep meanwhile when nothing else runs: on some hosts a pass right
  behind another runs faster than one after a pause, which a fleet, its jobs a client round trip apart, never gets.
"""

import asyncio
import json
import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

from shared.schemas import EventType, JobRequest
from workers.bench.http_client import Endpoint
from workers.worker.prompts import engine_prompt, sampling_params

PROMPTS = ("def parse(argv):", "import os\n", "class Queue:", "for i in range(", "The quick brown fox")


def request_mix(num: int, max_tokens: int) -> list[dict[str, Any]]:
    """Greedy, EOS ignored (every request emits exactly max_tokens), prompts cycled."""
    return [
        {"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
        for i in range(num)
    ]


@dataclass
class Timings:
    ttft_s: list[float] = field(default_factory=list)
    tpot_s: list[float] = field(default_factory=list)
    num_tokens: int = 0
    num_events: int = 0  # token events read (fleet) or step outputs with tokens (engine)
    elapsed_s: float = 0.0
    job_ids: list[str] = field(default_factory=list)  # fleet runs: the jobs, to read their records after
    # fleet runs, per job of job_ids: (request sent, first token read), wall clock (time.time(): Redis's clock
    # on this machine), to split the TTFT against the times Redis recorded (workers/bench/e2e_ttft.py)
    job_walls_s: list[tuple[float, float]] = field(default_factory=list)
    cpu_s: dict[str, float] = field(default_factory=dict)  # fleet runs: CPU seconds by process while they ran
    loop_s: dict[str, float] = field(default_factory=dict)  # fleet runs: the worker loop's seconds by part
    num_engine_steps: int = 0  # engine steps that made the tokens (the fleet's worker's, or in-process)
    num_pulled: dict[str, int] = field(default_factory=dict)  # fleet runs: jobs pulled by the loop, by the puller

    def merge(self, other: "Timings") -> None:
        """Add another run of the same system (a latency round): tokens/s becomes all tokens over all time."""
        self.ttft_s += other.ttft_s
        self.tpot_s += other.tpot_s
        self.num_tokens += other.num_tokens
        self.num_events += other.num_events
        self.elapsed_s += other.elapsed_s
        self.job_ids += other.job_ids
        self.job_walls_s += other.job_walls_s
        for name, seconds in other.cpu_s.items():
            self.cpu_s[name] = self.cpu_s.get(name, 0.0) + seconds
        for part, seconds in other.loop_s.items():
            self.loop_s[part] = self.loop_s.get(part, 0.0) + seconds
        self.num_engine_steps += other.num_engine_steps
        for by, num in other.num_pulled.items():
            self.num_pulled[by] = self.num_pulled.get(by, 0) + num

    def add(self, start_s: float, first_s: float, last_s: float, num_tokens: int, num_events: int) -> None:
        self.ttft_s.append(first_s - start_s)
        if num_tokens > 1:
            self.tpot_s.append((last_s - first_s) / (num_tokens - 1))
        self.num_tokens += num_tokens
        self.num_events += num_events


def percentile_ms(values: list[float], q: float) -> float:
    """q in [0, 100], nearest-rank on the sorted values; milliseconds."""
    if not values:
        return 0.0
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))
    return ordered[index] * 1e3


def summary(t: Timings) -> dict[str, float]:
    """The figures of a run; a fleet run's CPU by process as `<process>_cpu_us_per_token`, its worker loop's share
    of wall time by part as `loop_<part>_share` (workers/bench/e2e_loop.py)."""
    cpu = {f"{name}_cpu_us_per_token": seconds / t.num_tokens * 1e6 for name, seconds in t.cpu_s.items()
           if t.num_tokens}  # fmt: skip
    loop_total_s = sum(t.loop_s.values())
    loop = {f"loop_{part}_share": seconds / loop_total_s for part, seconds in t.loop_s.items() if loop_total_s > 0}
    if t.num_engine_steps:
        loop["tokens_per_engine_step"] = t.num_tokens / t.num_engine_steps
    if sum(t.num_pulled.values()):
        loop["pulled_by_puller_share"] = t.num_pulled.get("puller", 0) / sum(t.num_pulled.values())
    return {
        "ttft_ms_p50": percentile_ms(t.ttft_s, 50),
        "ttft_ms_p99": percentile_ms(t.ttft_s, 99),
        "tpot_ms_p50": percentile_ms(t.tpot_s, 50),
        "tpot_ms_p99": percentile_ms(t.tpot_s, 99),
        "tokens_per_s": t.num_tokens / t.elapsed_s if t.elapsed_s else 0.0,
        "num_requests": float(len(t.ttft_s)),
        "ttft_ms_mean": statistics.fmean(t.ttft_s) * 1e3 if t.ttft_s else 0.0,
        "tokens_per_event": t.num_tokens / t.num_events if t.num_events else 0.0,
        **cpu,
        **loop,
    }


# -- fleet -------------------------------------------------------------------------------------------------
async def _fleet_client(
    endpoint: Endpoint, bodies: list[dict[str, Any]], timings: Timings, one_request: bool
) -> None:
    """One keep-alive connection, one request after another. one_request: a submit that answers with the job's
    events (`Accept: text/event-stream`, as a streaming OpenAI call); else POST, then GET the job's stream."""
    conn = await endpoint.connect()
    try:
        for body in bodies:
            start, start_wall = time.perf_counter(), time.time()
            job_id = ""  # one request: named in the answer's headers
            if one_request:
                frames = conn.sse(endpoint.post("/v1/jobs", body, accept_events=True))
            else:
                status, raw = await conn.request(endpoint.post("/v1/jobs", body))
                if status != 202:
                    raise RuntimeError(f"submit answered {status}: {raw[:200]!r}")
                job_id = json.loads(raw)["id"]
                frames = conn.sse(endpoint.get(f"/v1/jobs/{job_id}/stream"))
            first = last = first_wall = 0.0
            num_tokens = num_events = 0
            async for frame in frames:
                if frame.event == EventType.TOKEN.value:
                    last = time.perf_counter()
                    if not first:
                        first, first_wall = last, time.time()
                    num_tokens += len(json.loads(frame.data)["token_ids"])
                    num_events += 1
                elif frame.event == EventType.ERROR.value:
                    raise RuntimeError(f"job {job_id or conn.headers.get('x-specfleet-job-id')} failed: {frame.data}")
            timings.job_ids.append(job_id or conn.headers["x-specfleet-job-id"])
            timings.job_walls_s.append((start_wall, first_wall))
            timings.add(start, first, last, num_tokens, num_events)
    finally:
        await conn.close()


async def run_fleet(
    endpoint: Endpoint, bodies: list[dict[str, Any]], num_clients: int, one_request: bool = True
) -> Timings:
    """`bodies` split over `num_clients` closed-loop clients (client i takes bodies i, i+N, ...)."""
    timings = Timings()
    start = time.perf_counter()
    await asyncio.gather(
        *(_fleet_client(endpoint, bodies[i::num_clients], timings, one_request) for i in range(num_clients))
    )
    timings.elapsed_s = time.perf_counter() - start
    return timings


# -- engine in-process ----------------------------------------------------------------------------------------
def run_engine(engine: Any, bodies: list[dict[str, Any]], num_clients: int, gap_s: float = 0.0) -> Timings:
    """The same closed loop against an in-process Engine (workers.engine.engine.Engine). `gap_s`: a client sends
    its next request that long after its previous one finished, not in the same step (the engine sleeps when it
    has nothing else to run), as a fleet's clients do a round trip apart."""
    queues = [bodies[i::num_clients] for i in range(num_clients)]
    live: dict[str, list[float]] = {}  # request id -> [start, first, last, num_tokens, num_events]
    client_of: dict[str, int] = {}  # request id -> its client
    due: list[tuple[float, int]] = []  # (when, client): next requests held back by the gap
    timings = Timings()
    num_started = 0

    def add_next(client: int) -> None:
        nonlocal num_started
        if not queues[client]:
            return
        request = JobRequest.model_validate(queues[client].pop(0))
        request_id = f"c{client}-{num_started}"
        num_started += 1
        live[request_id] = [time.perf_counter(), 0.0, 0.0, 0.0, 0.0]
        client_of[request_id] = client
        engine.add_request(request_id, engine_prompt(request, engine.tokenizer, []),
                           sampling_params(request, request.max_tokens))

    start = time.perf_counter()
    for client in range(num_clients):
        add_next(client)
    while engine.num_unfinished() or due:
        if due:
            now = time.perf_counter()
            if not engine.num_unfinished():  # nothing to step until the first held request is due
                time.sleep(max(0.0, min(when for when, _ in due) - now))
                now = time.perf_counter()
            for when, client in [d for d in due if d[0] <= now]:
                due.remove((when, client))
                add_next(client)
            if not engine.num_unfinished():
                continue
        outputs = engine.step()
        timings.num_engine_steps += 1
        now = time.perf_counter()
        for out in outputs:
            entry = live[out.request_id]
            if out.new_token_ids:
                entry[1] = entry[1] or now
                entry[2] = now
                entry[3] += len(out.new_token_ids)
                entry[4] += 1
            if out.finished:
                timings.add(entry[0], entry[1], entry[2], int(entry[3]), int(entry[4]))
                del live[out.request_id]
                client = client_of.pop(out.request_id)
                if gap_s > 0 and queues[client]:
                    due.append((now + gap_s, client))
                else:
                    add_next(client)
    timings.elapsed_s = time.perf_counter() - start
    return timings
