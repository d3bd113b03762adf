"""A lean asyncio HTTP/1.1 client for the e2e benchmark: one keep-alive connection per simulated client.

On 2 cores the benchmark client competes with the gateway for CPU, so it does the least it can: requests are
pre-encoded bytes, responses are read by Content-Length (or chunk by chunk for SSE), JSON is parsed only where
a figure needs it. It speaks exactly what uvicorn answers (HTTP/1.1, Content-Length or chunked), nothing more.
"""

import asyncio
import json
import os
import threading
import time
import urllib.request
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample


@dataclass
class SseFrame:
    event: str
    data: str  # json text
    id: str = ""  # the SSE `id:` (the event's entry id in the job's event stream)


def post_request(host: str, path: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> bytes:
    """A complete POST with a JSON body, ready to write (keep-alive)."""
    payload = json.dumps(body, separators=(",", ":")).encode()
    extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\n{extra}\r\n"
    )
    return head.encode() + payload


def get_request(host: str, path: str, headers: dict[str, str] | None = None) -> bytes:
    extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
    return f"GET {path} HTTP/1.1\r\nHost: {host}\r\n{extra}\r\n".encode()


@dataclass(frozen=True)
class Endpoint:
    """Where the benchmark clients go, and the headers every request carries (the API key)."""

    host: str
    port: int
    headers: tuple[tuple[str, str], ...] = ()

    def post(self, path: str, body: dict[str, Any], accept_events: bool = False) -> bytes:
        """accept_events: `Accept: text/event-stream` (a submit that answers with the job's events)."""
        extra = {"Accept": "text/event-stream"} if accept_events else {}
        return post_request(f"{self.host}:{self.port}", path, body, {**dict(self.headers), **extra})

    def get(self, path: str) -> bytes:
        return get_request(f"{self.host}:{self.port}", path, dict(self.headers))

    async def connect(self) -> "Connection":
        return await Connection(self.host, self.port).open()


class Connection:
    """One keep-alive HTTP/1.1 connection."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None
        self.headers: dict[str, str] = {}  # of the last event stream's response

    async def open(self) -> "Connection":
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port, limit=2**20)
        return self

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            try:
                await self.writer.wait_closed()
            except OSError:
                pass

    async def _head(self) -> tuple[int, dict[str, str]]:
        assert self.reader is not None
        raw = await self.reader.readuntil(b"\r\n\r\n")
        lines = raw.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ", 2)[1])
        headers = {}
        for line in lines[1:]:
            if line:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
        return status, headers

    async def request(self, raw: bytes) -> tuple[int, bytes]:
        """Send a pre-encoded request; -> (status, body). The answer must carry Content-Length."""
        assert self.reader is not None and self.writer is not None
        self.writer.write(raw)
        status, headers = await self._head()
        body = await self.reader.readexactly(int(headers.get("content-length", "0")))
        return status, body

    async def sse(self, raw: bytes) -> AsyncIterator[SseFrame]:
        """Send a request answered by an event stream (a GET of a job's stream, a submit that accepts events);
        yield its frames (keepalive comments skipped) up to the final event, then read the response to its end
        so the connection can carry the next request. The response's headers: `self.headers`."""
        assert self.reader is not None and self.writer is not None
        self.writer.write(raw)
        status, headers = await self._head()
        self.headers = headers
        if status != 200:
            raise RuntimeError(f"stream answered {status}")
        if headers.get("transfer-encoding") != "chunked":
            raise RuntimeError("expected a chunked event stream")
        pending = b""
        while True:
            size = int((await self.reader.readuntil(b"\r\n"))[:-2], 16)
            chunk = await self.reader.readexactly(size + 2)
            if size == 0:
                return
            pending += chunk[:-2]
            while b"\n\n" in pending:
                block, pending = pending.split(b"\n\n", 1)
                frame = _parse_frame(block.decode())
                if frame is not None:
                    yield frame


def _parse_frame(block: str) -> SseFrame | None:
    event, data, frame_id = "message", "", ""
    for line in block.split("\n"):
        if line.startswith("event: "):
            event = line[7:]
        elif line.startswith("data: "):
            data = line[6:]
        elif line.startswith("id: "):
            frame_id = line[4:]
    return SseFrame(event, data, frame_id) if data else None


def cpu_seconds(pid: int | None = None) -> float:
    """User + system CPU seconds of a process (this one by default), from /proc; 0 for one that is gone."""
    if pid is None:
        return time.process_time()
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:  # it exited
        return 0.0
    ticks = int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)
    return ticks / os.sysconf("SC_CLK_TCK")


def resident_mb(pid: int) -> float:
    """A process's resident set in MB (VmRSS, from /proc); 0 for one that is gone or where there is no /proc."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


class PeakResident:
    """`with PeakResident(pid) as peak:` the largest resident set of the process while the block ran
    (`peak.mb`), sampled every `interval_s` by a thread, the block's first and last moments included."""

    def __init__(self, pid: int, interval_s: float = 0.05) -> None:
        self.pid, self.interval_s = pid, interval_s
        self.mb = 0.0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="peak-resident", daemon=True)

    def _sample(self) -> None:
        while True:
            self.mb = max(self.mb, resident_mb(self.pid))
            if self._done.wait(self.interval_s):
                return

    def __enter__(self) -> "PeakResident":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()
        self.mb = max(self.mb, resident_mb(self.pid))


def metric_samples(url: str, headers: tuple[tuple[str, str], ...] = ()) -> Iterator[Sample]:
    """Every sample a process's /metrics page exports (the Prometheus text format, parsed)."""
    request = urllib.request.Request(url, headers=dict(headers))
    with urllib.request.urlopen(request, timeout=10) as response:
        text = response.read().decode()
    for family in text_string_to_metric_families(text):
        yield from family.samples
