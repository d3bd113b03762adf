"""The fleet's TTFT split from the times Redis recorded (workers/bench/e2e_ttft.py): a first token written in the
millisecond its job started reads 0 ms, never below (stream entry ids hold whole milliseconds)."""

import json

import redis

from shared import keys
from workers.bench.e2e_latency import Timings
from workers.bench.e2e_ttft import ttft_parts


def test_queued_and_first_write_from_the_records(rclient: redis.Redis, redis_url: str) -> None:
    # (created_at, started_at, the first token event's entry id): the first job's write came 0.3 ms after its
    # start, in the same millisecond, which its entry id cannot tell from the millisecond's start
    jobs = {"t1": ("999.9990", "1000.0004", "1000000-1"), "t2": ("999.9980", "1000.0009", "1000003-0"),
            "t3": ("999.9990", "1000.0021", "1000007-0")}  # fmt: skip
    for job_id, (created, started, token_id) in jobs.items():
        rclient.hset(keys.job_hash(job_id), mapping={"created_at": created, "started_at": started})
        rclient.xadd(keys.job_events(job_id), {"type": "status", "data": "{}"}, id="1000000-0")
        rclient.xadd(keys.job_events(job_id), {"type": "token", "data": "{}"}, id=token_id)
    timings = Timings(job_ids=list(jobs))
    parts = ttft_parts(redis_url, timings)
    # queued: 1.4, 2.9, 3.1 ms; first write: 0 (not -0.4), 3 and 5 ms
    assert round(parts["queued_ms_p50"], 3) == 2.9
    assert parts["first_write_ms_p50"] == 3.0
    single = ttft_parts(redis_url, Timings(job_ids=["t1"]))
    assert single["first_write_ms_p50"] == 0.0 and "submit_ms_p50" not in single  # no client clock: no split
    # the client's clock: each request sent 0.5, 0.8 and 1.2 ms before its job was created, its first token read
    # 0.9, 1.1 and 0.7 ms after the millisecond of its write
    walls = [(999.9985, 1000.0009), (999.9972, 1000.0041), (999.9978, 1000.0077)]
    split = ttft_parts(redis_url, Timings(job_ids=list(jobs), job_walls_s=walls))
    assert round(split["submit_ms_p50"], 3) == 0.8 and round(split["delivery_ms_p50"], 3) == 0.9
    assert split["queued_ms_p50"] == parts["queued_ms_p50"]
    assert "engine_ms_p50" not in parts  # no job's metrics recorded: no engine share


def test_the_worker_engine_s_own_ttft_from_the_jobs_metrics(rclient: redis.Redis, redis_url: str) -> None:
    ttfts_ms = {"m1": 1.25, "m2": 0.75, "m3": 2.5}
    for job_id, ttft_ms in ttfts_ms.items():
        rclient.hset(keys.job_hash(job_id), mapping={"created_at": "999.999", "started_at": "1000.0",
                                                     "metrics": json.dumps({"ttft_ms": ttft_ms, "compute_s": 0.01})})
        rclient.xadd(keys.job_events(job_id), {"type": "token", "data": "{}"}, id="1000003-0")
    rclient.hset(keys.job_hash("m4"), mapping={"created_at": "999.999", "started_at": "1000.0", "metrics": "{}"})
    rclient.xadd(keys.job_events("m4"), {"type": "token", "data": "{}"}, id="1000003-0")  # no ttft in its metrics
    parts = ttft_parts(redis_url, Timings(job_ids=[*ttfts_ms, "m4"]))
    assert parts["engine_ms_p50"] == 1.25 and parts["first_write_ms_p50"] == 3.0
