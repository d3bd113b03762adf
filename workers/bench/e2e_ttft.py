"""Where a fleet job's first token waited: the latency phase's TTFT split by the times Redis recorded.

    queued:       created_at -> started_at (the job hash, both Redis's clock): until a worker's pull took it,
                  which happens at an engine step's boundary
    first_write:  started_at -> the job's first token event (its stream entry id is Redis's clock at the write,
                  in whole milliseconds: started_at is cut to its millisecond too, so a write within the
                  millisecond of the start reads 0, not below): the engine step that prefilled it, then the
                  worker's writer process
    engine:       of first_write, the worker's engine's own TTFT (the job's `metrics.ttft_ms`: the engine's clock
                  from the job's admission to its first token, to the microsecond; a job the worker's engine
                  ran twice, resumed, counts its last run): against the in-process engine's TTFT, what the
                  worker's engine adds; first_write less this, the pull's reply, admission and the write
The rest, where the client's wall clock (the same machine's) is known (Timings.job_walls_s):
    submit:       the request sent -> created_at: the client's write, the gateway's handling, the submit script
    delivery:     the first token written -> the client read it: the publish, the gateway's wake-up and write, the
                  client's read (from the write's millisecond: up to 1 ms more than it took)
"""

import json
import math

from shared import keys
from shared import redis_url as redis_urls
from workers.bench.e2e_latency import Timings, percentile_ms

EVENTS_READ = 8  # a job's first events: status `running`, then its first token (a resumed job: a few more)


def _first_token_ms(events: list[tuple[str, dict[str, str]]]) -> int | None:
    for entry_id, fields in events:
        if fields.get("type") == "token":
            return int(entry_id.split("-")[0])
    return None


def ttft_parts(redis_url: str, timings: Timings) -> dict[str, float]:
    """p50 of `queued_ms`, `first_write_ms` and `engine_ms` over the fleet run's jobs, from their records."""
    client = redis_urls.client(redis_url, decode_responses=True)
    try:
        pipe = redis_urls.pipeline(client, transaction=False)
        for job_id in timings.job_ids:
            pipe.hmget(keys.job_hash(job_id), ["created_at", "started_at", "metrics"])
            pipe.xrange(keys.job_events(job_id), count=EVENTS_READ)
        replies = pipe.execute()
    finally:
        client.close()
    walls = timings.job_walls_s if len(timings.job_walls_s) == len(timings.job_ids) else []
    queued_s, first_write_s, engine_s, submit_s, delivery_s = [], [], [], [], []
    for i, ((created, started, metrics), events) in enumerate(zip(replies[::2], replies[1::2], strict=True)):
        first_ms = _first_token_ms(events)
        if created is None or started is None or first_ms is None:
            continue
        queued_s.append(float(started) - float(created))
        first_write_s.append((first_ms - math.floor(float(started) * 1000)) / 1000)
        engine_ttft_ms = json.loads(metrics).get("ttft_ms") if metrics else None
        if engine_ttft_ms is not None:
            engine_s.append(engine_ttft_ms / 1000)
        if walls:
            sent_s, read_s = walls[i]
            submit_s.append(float(created) - sent_s)
            delivery_s.append(read_s - first_ms / 1000)
    parts = {"queued_ms_p50": percentile_ms(queued_s, 50), "first_write_ms_p50": percentile_ms(first_write_s, 50)}
    if engine_s:
        parts["engine_ms_p50"] = percentile_ms(engine_s, 50)
    if walls:
        parts |= {"submit_ms_p50": percentile_ms(submit_s, 50), "delivery_ms_p50": percentile_ms(delivery_s, 50)}
    return parts
