"""A small synchronous client of the gateway's HTTP API: jobs (the CLI's submit/status/stream/cancel, tests) and
batches (`specfleet batch ...`). It speaks HTTP only: imports httpx, never gateway/ or workers/."""

import json
import os
import time
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

API_KEY_ENV = "SPECFLEET_API_KEY"  # the key the CLI's client sends (`specfleet up` prints one in dev mode)


@dataclass
class SseEvent:
    id: str
    event: str
    data: dict[str, Any]


def iter_sse(lines: Iterable[str]) -> Iterator[SseEvent]:
    """Parse a text/event-stream (comments and keepalives skipped)."""
    entry_id, event, data = "", "message", list[str]()
    for line in lines:
        if not line:
            if data:
                yield SseEvent(id=entry_id, event=event, data=json.loads("\n".join(data)))
            entry_id, event, data = "", "message", list[str]()
        elif line.startswith(":"):
            continue
        else:
            name, _, value = line.partition(":")
            value = value.removeprefix(" ")
            if name == "id":
                entry_id = value
            elif name == "event":
                event = value
            elif name == "data":
                data.append(value)


class FleetApiError(Exception):
    """An error answer; `body` keeps all of it (a refused batch lists every bad line in `error.data`)."""

    def __init__(self, status_code: int, body: dict[str, Any]) -> None:
        error = body.get("error", {})
        super().__init__(f"{status_code} {error.get('code', '?')}: {error.get('message', body)}")
        self.status_code = status_code
        self.code = error.get("code")
        self.body = body


BATCH_SUBMIT_TRIES = 3  # a batch submit whose connection failed is sent again, with its Idempotency-Key


class FleetClient:
    def __init__(self, base_url: str, timeout_s: float = 30.0, api_key: str | None = None) -> None:
        api_key = api_key or os.environ.get(API_KEY_ENV)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(base_url=base_url, timeout=timeout_s, headers=headers)

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> "FleetClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @staticmethod
    def _json(response: httpx.Response) -> dict[str, Any]:
        body: dict[str, Any] = response.json()
        if response.status_code >= 400:
            raise FleetApiError(response.status_code, body)
        return body

    def submit(
        self, body: dict[str, Any], *, idempotency_key: str | None = None, wait_s: float | None = None
    ) -> dict[str, Any]:
        headers = {}
        if idempotency_key:
            headers["Idempotency-Key"] = idempotency_key
        if wait_s:
            headers["Prefer"] = f"wait={wait_s:g}"
        return self._json(self.http.post("/v1/jobs", json=body, headers=headers))

    def submit_stream(self, body: dict[str, Any], *, idempotency_key: str | None = None) -> Iterator[SseEvent]:
        """Queue a job and stream its events in the same request (`Accept: text/event-stream`)."""
        headers = {"Accept": "text/event-stream"}
        if idempotency_key:
            headers["Idempotency-Key"] = idempotency_key
        yield from self._events("POST", "/v1/jobs", headers, json=body)

    def get(self, job_id: str) -> dict[str, Any]:
        return self._json(self.http.get(f"/v1/jobs/{job_id}"))

    def cancel(self, job_id: str) -> dict[str, Any]:
        return self._json(self.http.post(f"/v1/jobs/{job_id}/cancel"))

    def stream(self, job_id: str, last_event_id: str | None = None) -> Iterator[SseEvent]:
        """The job's events from the start (or after `last_event_id`) up to its final event."""
        headers = {"Last-Event-ID": last_event_id} if last_event_id else {}
        yield from self._events("GET", f"/v1/jobs/{job_id}/stream", headers)

    def _events(self, method: str, path: str, headers: dict[str, str], **options: Any) -> Iterator[SseEvent]:
        """A request answered by an event stream: its events (no read timeout), or the API's error raised."""
        timeout = httpx.Timeout(self.http.timeout.connect, read=None)
        with self.http.stream(method, path, headers=headers, timeout=timeout, **options) as response:
            if response.status_code >= 400:
                response.read()
                self._json(response)
            yield from iter_sse(response.iter_lines())

    # -- batches ----------------------------------------------------------------------------------------------
    def submit_batch(
        self, path: Path, webhook: str | None = None, metadata: dict[str, str] | None = None
    ) -> dict[str, Any]:
        """Upload a JSONL file (multipart) -> the batch. Sent with an Idempotency-Key, and sent again with it when
        the connection fails (BATCH_SUBMIT_TRIES in all): a lost answer makes one batch, not two."""
        data: dict[str, str] = {}
        if webhook:
            data["webhook"] = webhook
        if metadata:
            data["metadata"] = json.dumps(metadata)
        headers = {"Idempotency-Key": f"specfleet-batch-{uuid.uuid4().hex}"}
        for attempt in range(1, BATCH_SUBMIT_TRIES + 1):
            try:
                with path.open("rb") as f:
                    files = {"file": (path.name, f, "application/jsonl")}
                    return self._json(self.http.post("/v1/batches", files=files, data=data, headers=headers))
            except httpx.TransportError:
                if attempt == BATCH_SUBMIT_TRIES:
                    raise
                time.sleep(attempt)  # 1 s, then 2 s
        raise AssertionError("unreachable")

    def get_batch(self, batch_id: str) -> dict[str, Any]:
        return self._json(self.http.get(f"/v1/batches/{batch_id}"))

    def cancel_batch(self, batch_id: str) -> dict[str, Any]:
        return self._json(self.http.post(f"/v1/batches/{batch_id}/cancel"))

    def list_jobs(self, limit: int = 20, after: str | None = None, status: str | None = None) -> dict[str, Any]:
        """A page of the key's jobs, newest first (GET /v1/jobs), those in `status` if given."""
        params: dict[str, str | int] = {"limit": limit}
        if after:
            params["after"] = after
        if status:
            params["status"] = status
        return self._json(self.http.get("/v1/jobs", params=params))

    def list_batches(self, limit: int = 20, after: str | None = None) -> dict[str, Any]:
        params: dict[str, str | int] = {"limit": limit}
        if after:
            params["after"] = after
        return self._json(self.http.get("/v1/batches", params=params))

    def batch_results(self, batch_id: str) -> Iterator[bytes]:
        """The results file, streamed."""
        with self.http.stream("GET", f"/v1/batches/{batch_id}/results") as response:
            if response.status_code >= 400:
                response.read()
                self._json(response)
            yield from response.iter_bytes()
