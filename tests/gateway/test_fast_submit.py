"""POST /v1/jobs's short path (gateway/fast_submit.py) answers every request as FastAPI's own path does: the
same requests are sent with the short path on and off (any dependency override turns it off), over real HTTP."""

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from fastapi import APIRouter, FastAPI

from gateway.fast_submit import FastSubmitRoute
from shared.settings import ServiceSettings
from tests.helpers.gateway import ThreadedGateway

JSON = {"content-type": "application/json"}
REQUESTS: list[tuple[str, dict[str, str], bytes]] = [  # (what, headers, body)
    ("plain", JSON, b'{"prompt": "x", "max_tokens": 2}'),
    ("charset", {"content-type": "application/json; charset=utf-8"}, b'{"prompt": "x", "max_tokens": 2}'),
    ("headers", {**JSON, "Idempotency-Key": "k-1", "Cancel-After": "30s", "Prefer": "respond-async"},
     b'{"prompt": "x", "max_tokens": 2}'),
    ("replay", {**JSON, "Idempotency-Key": "k-1"}, b'{"prompt": "x", "max_tokens": 2}'),
    ("conflict", {**JSON, "Idempotency-Key": "k-1"}, b'{"prompt": "y", "max_tokens": 2}'),
    ("invalid json", JSON, b'{"prompt": '),
    ("deep json", JSON, b"[" * 100_000 + b"]" * 100_000),
    ("empty body", JSON, b""),
    ("unknown field", JSON, b'{"prompt": "x", "colour": 1}'),
    ("text body", {"content-type": "text/plain"}, b'{"prompt": "x"}'),
    ("no content type", {}, b'{"prompt": "x"}'),
    ("empty idempotency key", {**JSON, "Idempotency-Key": ""}, b'{"prompt": "x"}'),
    ("long idempotency key", {**JSON, "Idempotency-Key": "k" * 257}, b'{"prompt": "x"}'),
    ("long cancel-after", {**JSON, "Cancel-After": "1" * 65}, b'{"prompt": "x"}'),
    ("bad cancel-after", {**JSON, "Cancel-After": "soon"}, b'{"prompt": "x"}'),
    ("no key", {**JSON, "Authorization": ""}, b'{"prompt": "x"}'),
    ("unknown key", {**JSON, "Authorization": "Bearer sf-" + "y" * 43}, b'{"prompt": "x"}'),
]


@pytest.fixture
def server(settings: ServiceSettings) -> Iterator[ThreadedGateway]:
    with ThreadedGateway(settings).start() as gateway:
        yield gateway


def _app(server: ThreadedGateway) -> FastAPI:
    app = server.server.config.app.app  # inside the tests' default-key shim
    assert isinstance(app, FastAPI)
    return app


def _answer(response: httpx.Response) -> tuple[int, Any]:
    body = response.json()
    if response.status_code in (200, 202):  # a new job each time: compare its shape, not its id
        return response.status_code, (sorted(body), body["status"])
    if "job" in body["error"]["message"]:  # the conflict names the job
        body["error"]["message"] = body["error"]["message"].split(" (job")[0]
    return response.status_code, body


def test_the_short_path_answers_as_fastapis_own(server: ThreadedGateway) -> None:
    app = _app(server)
    answers: dict[bool, list[tuple[int, Any]]] = {}
    with httpx.Client(base_url=server.url, timeout=30) as http:
        for is_short in (True, False):
            app.dependency_overrides = {} if is_short else {_answer: lambda: None}  # any override: FastAPI's path
            answers[is_short] = []
            for _what, headers, body in REQUESTS:
                name = headers.get("Idempotency-Key")
                if name and name.startswith("k-"):  # each path has its own Idempotency-Key
                    headers = {**headers, "Idempotency-Key": f"{name}-{is_short}"}
                answers[is_short].append(_answer(http.post("/v1/jobs", content=body, headers=headers)))
    app.dependency_overrides = {}
    for (what, _, _), short, fastapi in zip(REQUESTS, answers[True], answers[False], strict=True):
        assert short == fastapi, what
    statuses = dict(zip([what for what, _, _ in REQUESTS], [status for status, _ in answers[True]], strict=True))
    assert statuses["plain"] == statuses["headers"] == 202 and statuses["conflict"] == 422
    assert statuses["unknown key"] == statuses["no key"] == 401


def test_the_short_path_serves_only_the_submit_function() -> None:
    router = APIRouter(route_class=FastSubmitRoute)

    async def other(body: dict[str, str]) -> None: ...

    with pytest.raises(TypeError, match="FastSubmitRoute serves a function of"):
        router.post("/elsewhere")(other)
