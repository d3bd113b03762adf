"""The cost phase of `specfleet bench e2e`: cost per 1,000 generated tokens through the fleet, at each
concurrency, with speculation on (the engine's default method) and off.

Figures come from the job records the worker wrote (`metrics.compute_s`: each job's share of engine time,
workers/worker/cost.py), so they are what a fleet's users are billed from, not a model of it. The worker's
price may be 0 (unset); the bench prices compute at `price_per_worker_hour or 1.0`, so `cost_per_1k` reads as
"worker-hours' price per 1,000 tokens" then. Both speculation settings run the same request mix, one right
after the other at each level (the same minute of machine noise).
"""

import asyncio
from typing import Any

import redis

from shared import keys
from shared.job_record import job_from_fields
from workers.bench.e2e_latency import Timings, run_fleet
from workers.bench.http_client import Endpoint
from workers.worker.cost import CostMeter


def billed(redis_url: str, timings: Timings) -> tuple[float, int]:
    """(compute_s, completion tokens) summed over the finished jobs of one fleet run, from their records."""
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        pipe = client.pipeline(transaction=False)
        for job_id in timings.job_ids:
            pipe.hgetall(keys.job_hash(job_id))
        compute_s, num_tokens = 0.0, 0
        for fields in pipe.execute():
            job = job_from_fields(fields, "")
            compute_s += job.metrics.compute_s or 0.0
            num_tokens += job.usage.completion_tokens if job.usage else 0
        return compute_s, num_tokens
    finally:
        client.close()


def cost_row(redis_url: str, timings: Timings, concurrency: int, speculative: bool, price: float) -> dict[str, Any]:
    compute_s, num_tokens = billed(redis_url, timings)
    return {
        "phase": "cost", "system": "fleet", "concurrency": concurrency,
        "speculation": "on" if speculative else "off",
        "tokens": num_tokens,
        "compute_s_per_1k": compute_s / num_tokens * 1000 if num_tokens else 0.0,
        "cost_per_1k": CostMeter(price).cost_of(compute_s) / num_tokens * 1000 if num_tokens else 0.0,
    }


def plain_run(endpoint: Endpoint, bodies: list[dict[str, Any]], concurrency: int) -> Timings:
    """The same request mix with speculation off."""
    return asyncio.run(run_fleet(endpoint, [{**b, "speculative": False} for b in bodies], concurrency))


def cost_ratios(rows: list[dict[str, Any]]) -> dict[str, float]:
    by = {(r["speculation"], r["concurrency"]): r for r in rows if r["phase"] == "cost"}
    ratios: dict[str, float] = {}
    for (speculation, c), row in sorted(by.items()):
        suffix = "" if speculation == "on" else "_plain"
        ratios[f"cost_per_1k{suffix}_c{c}"] = row["cost_per_1k"]
        off = by.get(("off", c))
        if speculation == "on" and off and off["cost_per_1k"] > 0:
            ratios[f"cost_per_1k_sd_vs_plain_c{c}"] = row["cost_per_1k"] / off["cost_per_1k"]
    return ratios
