"""Shared fixtures: one real redis-server per test session (flushed per test), settings pointing at it,
and a real gateway (uvicorn on a free port, in a thread of the test process)."""

import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import redis
import uvicorn
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.main import create_app
from shared import lua
from shared.api_keys import ApiKey, KeyRegistry
from shared.redis_server import RedisServer, free_port
from shared.schemas import JobRequest
from shared.settings import ServiceSettings
from shared.submit import submit_call

# fixtures of the whole suite: tests/helpers/
pytest_plugins = ["tests.helpers.models", "tests.helpers.engine_worker", "tests.helpers.tasks"]
FAST_TIMINGS = {
    "heartbeat_interval_s": 0.2,
    "claim_timeout_s": 1.0,
    "reclaim_interval_s": 0.2,
    "sse_keepalive_s": 1.0,
    "idle_block_ms": 50,
    "model_info_refresh_s": 0.0,
    "shutdown_grace_s": 0.0,
}


def wait_until(condition, timeout_s: float = 10.0, interval_s: float = 0.01, what: str = "condition"):  # noqa: ANN001, ANN201
    """Poll `condition()` until it returns something truthy (returned), failing after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(interval_s)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    with RedisServer(tmp_path_factory.mktemp("redis"), appendonly=False) as server:
        yield server


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    client.close()
    return redis_server.url


@pytest.fixture
def rclient(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    yield client
    client.close()


@pytest.fixture
def settings(redis_url: str, tmp_path: Path) -> ServiceSettings:
    return ServiceSettings(redis_url=redis_url, redis_dir=tmp_path / "redis", **FAST_TIMINGS)  # type: ignore[arg-type]


def create_key(redis_url: str, name: str = "test", **limits: object) -> tuple[ApiKey, str]:
    """A new API key in the test Redis (unlimited unless limits are given) -> (its record, its secret)."""
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        options = {"requests_per_min": 0, "tokens_per_min": 0, "max_concurrent_jobs": 0, **limits}
        return KeyRegistry(client).create(name, **options)  # type: ignore[arg-type]
    finally:
        client.close()


class _DefaultKey:
    """ASGI shim of the tests that are not about authentication: a request without an Authorization header
    gets the test's admin key (the gateway itself always requires one)."""

    def __init__(self, app: ASGIApp, secret: str) -> None:
        self.app = app
        self.header = (b"authorization", f"Bearer {secret}".encode())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and not any(k == b"authorization" for k, _ in scope["headers"]):
            scope = {**scope, "headers": [*scope["headers"], self.header]}
        await self.app(scope, receive, send)


class ThreadedGateway:
    """The real gateway app served by uvicorn on a free port, in a background thread.

    default_key: requests without an Authorization header are sent with a fresh admin key (`self.api_key`),
    for the tests of everything but authentication. False: the gateway exactly as deployed."""

    def __init__(self, settings: ServiceSettings, default_key: bool = True) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        app: ASGIApp = create_app(settings)
        self.api_key = ""
        if default_key:
            assert settings.redis_url is not None
            try:
                self.api_key = create_key(
                    settings.redis_url,
                    "tests-admin",
                    is_admin=True,
                    webhook_secret=settings.webhook_secret.get_secret_value(),  # the service's: tests verify it
                )[1]
            except redis.ConnectionError:  # the tests of a gateway whose Redis is down
                self.api_key = "sf-no-redis"
            app = _DefaultKey(app, self.api_key)
        config = uvicorn.Config(
            app,
            host="127.0.0.1",
            port=self.port,
            log_level="warning",
            ws="none",
            lifespan="on",
            timeout_graceful_shutdown=1,
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="gateway", daemon=True)

    def start(self) -> "ThreadedGateway":
        self.thread.start()
        wait_until(lambda: self.server.started, what="the gateway to start")
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)

    def __enter__(self) -> "ThreadedGateway":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@pytest.fixture
def gateway(settings: ServiceSettings) -> Iterator[ThreadedGateway]:
    server = ThreadedGateway(settings).start()
    yield server
    server.stop()


def submit_job(
    client: redis.Redis, settings: ServiceSettings, idempotency_key: str | None = None, **request: object
) -> str:
    """Queue a job straight through the SUBMIT script (what POST /v1/jobs runs), without a gateway."""
    body = JobRequest.model_validate({"prompt": "hello", **request})
    keys_, args = submit_call(body, uuid.uuid4().hex, idempotency_key, settings)
    result = client.register_script(lua.SUBMIT)(keys=keys_, args=args)
    assert result[0] in ("ok", "dup"), result
    return str(result[1])


@dataclass
class StepOut:
    """The fields of the engine's StepOutput that the worker reads (tests that play the engine)."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool = False
    finish_reason: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)


class PlayedWorker:
    """The worker's Redis side driven by a test: take a job, emit tokens, finish — with the real scripts."""

    def __init__(self, client: redis.Redis, settings: ServiceSettings, worker_id: str = "played") -> None:
        from workers.worker.emitter import Emitter
        from workers.worker.queue_reader import QueueReader

        self.reader = QueueReader(client, settings, worker_id)
        self.reader.ensure_groups()
        self.emitter = Emitter(client, settings)
        self.running: dict = {}

    def take(self, timeout_s: float = 10.0) -> str:
        from workers.worker.emitter import Running

        lease = wait_until(lambda: self.reader.pull(1), timeout_s, what="a job to take")[0]
        self.running[lease.job_id] = Running(lease.job_id, lease.attempt, prompt_tokens=3)
        return lease.job_id

    def emit(self, job_id: str, token_ids: list[int], text: str, finish_reason: str | None = None):  # noqa: ANN201
        out = StepOut(
            job_id, token_ids, text, finished=finish_reason is not None, finish_reason=finish_reason
        )
        return self.emitter.emit(self.running, [out])
