"""Gateway load: submit rate (no worker running), Redis ceilings measured in the same run, and many SSE streams
held at once with every token counted."""

import asyncio
import json
import resource
import socket
import time
import uuid
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

from shared import lua
from shared import redis_url as redis_urls
from shared.schemas import EventType, JobRequest
from shared.settings import ServiceSettings
from shared.submit import submit_call
from workers.bench.http_client import Endpoint, cpu_seconds

REDIS_PIPELINE = 16  # commands per pipeline in the ceiling loops (as NOTES-CPU.md's redis-benchmark -P 16)
SUBMIT_BODY = {"prompt": "def parse(argv):", "max_tokens": 16, "temperature": 0, "priority": "batch"}


@dataclass
class SubmitResult:
    num_jobs: int
    elapsed_s: float
    client_cpu_s: float  # this process while it ran the clients

    @property
    def jobs_per_s(self) -> float:
        return self.num_jobs / self.elapsed_s


async def _submitter(endpoint: Endpoint, raw: bytes, remaining: list[int]) -> None:
    conn = await endpoint.connect()
    try:
        while remaining[0] > 0:
            remaining[0] -= 1
            status, body = await conn.request(raw)
            if status != 202:
                raise RuntimeError(f"submit answered {status}: {body[:200]!r}")
    finally:
        await conn.close()


async def submit_rate(endpoint: Endpoint, num_jobs: int, num_clients: int) -> SubmitResult:
    """`num_clients` keep-alive connections POST /v1/jobs, one request in flight each, `num_jobs` in all."""
    raw = endpoint.post("/v1/jobs", SUBMIT_BODY)
    remaining = [num_jobs]
    cpu0, start = cpu_seconds(), time.perf_counter()
    await asyncio.gather(*(_submitter(endpoint, raw, remaining) for _ in range(num_clients)))
    return SubmitResult(num_jobs, time.perf_counter() - start, cpu_seconds() - cpu0)


def _resp(*parts: str) -> bytes:
    """One Redis command in RESP."""
    out = [f"*{len(parts)}\r\n".encode()]
    for part in parts:
        data = part.encode()
        out.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(out)


def xadd_ceiling(redis_url: str, num: int) -> float:
    """XADDs per second, redis-benchmark style: raw RESP over one socket, pipelines of REDIS_PIPELINE (no
    client library in the way: each reply is one bulk string, two CRLF-terminated lines)."""
    parsed = urlparse(redis_url)
    batch = _resp("XADD", "bench:xadd", "*", "id", uuid.uuid4().hex) * REDIS_PIPELINE
    num_batches = max(1, num // REDIS_PIPELINE)
    with socket.create_connection((parsed.hostname or "127.0.0.1", parsed.port or 6379)) as sock:
        start = time.perf_counter()
        for _ in range(num_batches):
            sock.sendall(batch)
            pending = 2 * REDIS_PIPELINE  # reply lines still to read
            while pending:
                data = sock.recv(65536)
                if not data or data.startswith(b"-"):
                    raise RuntimeError(f"XADD failed: {data[:200]!r}")
                pending -= data.count(b"\r\n")
        elapsed_s = time.perf_counter() - start
        sock.sendall(_resp("DEL", "bench:xadd"))
        sock.recv(64)
    return num_batches * REDIS_PIPELINE / elapsed_s


def submit_script_ceiling(redis_url: str, num: int, settings: ServiceSettings) -> float:
    """The gateway's SUBMIT script (hash + enqueue + idempotency + limit) per second, pipelined: Redis's own
    cost of one job, with no HTTP in front of it."""
    client = redis_urls.client(redis_url, decode_responses=True)
    script = client.register_script(lua.SUBMIT)
    request = JobRequest.model_validate(SUBMIT_BODY)
    calls = [submit_call(request, uuid.uuid4().hex, None, settings) for _ in range(num)]
    try:
        start = time.perf_counter()
        for i in range(0, num, REDIS_PIPELINE):
            pipe = client.pipeline(transaction=False)
            for keys_, args in calls[i : i + REDIS_PIPELINE]:
                script(keys=keys_, args=args, client=pipe)
            pipe.execute()
        return num / (time.perf_counter() - start)
    finally:
        client.close()


# -- SSE ---------------------------------------------------------------------------------------------------
def raise_fd_limit(wanted: int) -> int:
    """Raise this process's soft limit on open files toward `wanted` (never past the hard limit; child processes
    inherit it) -> the soft limit now. Each SSE stream is one socket in the client and one in the gateway."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        soft = target
    return int(soft)


@dataclass
class StreamCount:
    num_streams: int = 0
    num_open: int = 0
    peak_open: int = 0
    num_token_events: int = 0
    lost_tokens: int = 0  # tokens of the job's output its stream did not carry in place (missing, extra, moved)
    num_out_of_order: int = 0  # events whose id was not after the previous one's
    num_failed: int = 0


def lost_tokens(expected: list[int], streamed: list[int]) -> int:
    """0 when the stream carried exactly the job's tokens in order; else how many are missing or out of place."""
    if streamed == expected:
        return 0
    num_same = next((i for i, (a, b) in enumerate(zip(expected, streamed, strict=False)) if a != b),
                    min(len(expected), len(streamed)))  # fmt: skip
    return max(len(expected), len(streamed)) - num_same


async def _follow(endpoint: Endpoint, job_id: str, count: StreamCount) -> None:
    conn = await endpoint.connect()
    streamed: list[int] = []
    last_key = (0, 0)
    try:
        count.num_open += 1
        count.peak_open = max(count.peak_open, count.num_open)
        async for frame in conn.sse(endpoint.get(f"/v1/jobs/{job_id}/stream")):
            key = lua.entry_key(frame.id) if frame.id else last_key
            count.num_out_of_order += key <= last_key
            last_key = key
            if frame.event == EventType.TOKEN.value:
                count.num_token_events += 1
                streamed += json.loads(frame.data)["token_ids"]
            elif frame.event == EventType.ERROR.value:
                count.num_failed += 1
        status, raw = await conn.request(endpoint.get(f"/v1/jobs/{job_id}"))
        output = json.loads(raw).get("output") or {} if status == 200 else {}
        count.lost_tokens += lost_tokens(list(output.get("token_ids") or []), streamed)
    finally:
        count.num_open -= 1
        await conn.close()


async def hold_streams(endpoint: Endpoint, num_streams: int, body: dict[str, Any]) -> StreamCount:
    """Submit `num_streams` jobs, then follow each on its own SSE connection, all opened at once; every stream's
    tokens are checked against its job's final output (GET /v1/jobs/{id}) once the stream ends."""
    raw = endpoint.post("/v1/jobs", body)
    conn = await endpoint.connect()
    job_ids = []
    try:
        for _ in range(num_streams):
            status, answer = await conn.request(raw)
            if status != 202:
                raise RuntimeError(f"submit answered {status}: {answer[:200]!r}")
            job_ids.append(json.loads(answer)["id"])
    finally:
        await conn.close()
    count = StreamCount(num_streams=num_streams)
    await asyncio.gather(*(_follow(endpoint, job_id, count) for job_id in job_ids))
    return count
