"""A small synchronous client of `/v1/batches` (the `specfleet batch` commands, tests)."""

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from gateway.client import API_KEY_ENV
from gateway.client import FleetApiError as ApiError


class BatchApiError(ApiError):
    """An error answer; `body` keeps `error.data` (every bad line of a refused batch)."""

    def __init__(self, status_code: int, body: dict[str, Any]) -> None:
        super().__init__(status_code, body)
        self.body = body


class BatchClient:
    def __init__(self, base_url: str, timeout_s: float = 60.0, api_key: str | None = None) -> None:
        api_key = api_key or os.environ.get(API_KEY_ENV)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(base_url=base_url, timeout=timeout_s, headers=headers)

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> "BatchClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @staticmethod
    def _json(response: httpx.Response) -> dict[str, Any]:
        body: dict[str, Any] = response.json()
        if response.status_code >= 400:
            raise BatchApiError(response.status_code, body)
        return body

    def submit(
        self, path: Path, webhook: str | None = None, metadata: dict[str, str] | None = None
    ) -> dict[str, Any]:
        """Upload a JSONL file (multipart) -> the batch."""
        import json

        data: dict[str, str] = {}
        if webhook:
            data["webhook"] = webhook
        if metadata:
            data["metadata"] = json.dumps(metadata)
        with path.open("rb") as f:
            files = {"file": (path.name, f, "application/jsonl")}
            return self._json(self.http.post("/v1/batches", files=files, data=data))

    def get(self, batch_id: str) -> dict[str, Any]:
        return self._json(self.http.get(f"/v1/batches/{batch_id}"))

    def cancel(self, batch_id: str) -> dict[str, Any]:
        return self._json(self.http.post(f"/v1/batches/{batch_id}/cancel"))

    def list(self, limit: int = 20, after: str | None = None) -> dict[str, Any]:
        params: dict[str, str | int] = {"limit": limit}
        if after:
            params["after"] = after
        return self._json(self.http.get("/v1/batches", params=params))

    def results(self, batch_id: str) -> Iterator[bytes]:
        """The results file, streamed."""
        with self.http.stream("GET", f"/v1/batches/{batch_id}/results") as response:
            if response.status_code >= 400:
                response.read()
                self._json(response)
            yield from response.iter_bytes()
