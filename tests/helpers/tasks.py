"""Fixtures for the webhook/batch tests: a real Celery worker process and a real HTTP receiver on loopback
that records and verifies what it gets (the engine worker: tests/helpers/engine_worker.py)."""

import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import redis

from shared import keys
from shared import redis_url as redis_urls
from shared.procs import die_with_parent
from shared.redis_server import free_port
from shared.settings import ServiceSettings
from shared.webhook_signing import verify
from tests.helpers import REPO_ROOT
from tests.helpers.waiting import wait_until

# Fast retries so that a test sees several attempts in well under a second.
TASK_TIMINGS = {
    "webhook_retry_base_s": 0.05,
    "webhook_retry_max_s": 0.4,
    "webhook_timeout_s": 2.0,
    "webhook_max_attempts": 5,
    "webhook_output_interval_ms": 200,
    "batch_chunk_lines": 40,
    "batch_retry_s": 0.2,
    "batch_reconcile_interval_s": 0.5,
}
LOOPBACK = ["127.0.0.0/8", "::1"]


@pytest.fixture
def hook_settings(settings: ServiceSettings) -> ServiceSettings:
    """The test settings, with loopback allowlisted for webhooks and fast retries."""
    settings.webhook_allow_hosts = list(LOOPBACK)
    for name, value in TASK_TIMINGS.items():
        setattr(settings, name, value)
    settings.tasks_metrics_port = free_port()  # the Celery worker serves /metrics (workers/tasks/metrics.py)
    return settings


def settings_env(settings: ServiceSettings) -> dict[str, str]:
    """The environment that gives a child process the same settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECFLEET_")}
    env.update(
        {
            "REDIS_URL": str(settings.redis_url),
            "SPECFLEET_WEBHOOK_ALLOW_HOSTS": ",".join(settings.webhook_allow_hosts),
            "SPECFLEET_WEBHOOK_SECRET": settings.webhook_secret.get_secret_value(),
            "PYTHONPATH": str(REPO_ROOT),
        }
    )
    for name in (*TASK_TIMINGS, "batch_max_inflight_lines_per_key", "redis_partitions"):
        env[f"SPECFLEET_{name.upper()}"] = str(getattr(settings, name))
    for priority in ("interactive", "default", "batch"):
        env[f"SPECFLEET_QUEUE_LIMITS__{priority.upper()}"] = str(getattr(settings.queue_limits, priority))
    if settings.public_url:
        env["SPECFLEET_PUBLIC_URL"] = settings.public_url
    if settings.celery_broker_url:
        env["SPECFLEET_CELERY_BROKER_URL"] = settings.celery_broker_url
    if settings.tasks_metrics_port:
        env["SPECFLEET_TASKS_METRICS_PORT"] = str(settings.tasks_metrics_port)
    return env


class CeleryWorker:
    """`celery -A workers.tasks.celery_app worker` as a child process; stopped with SIGTERM (warm shutdown)."""

    def __init__(self, settings: ServiceSettings, log_path: Path) -> None:
        self.settings = settings
        self.log_path = log_path
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> "CeleryWorker":
        args = [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "workers.tasks.celery_app",
            "worker",
            "--pool=threads",
            "--concurrency=2",
            "--loglevel=INFO",
            "--hostname=test@%h",
            "--without-mingle",
            "--without-gossip",
            "--without-heartbeat",
        ]
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                args,
                cwd=REPO_ROOT,
                env=settings_env(self.settings),
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=die_with_parent,
            )
        client = redis_urls.client(str(self.settings.redis_url), decode_responses=True)
        try:
            wait_until(lambda: self._bridge_reading(client), 30, 0.05, "the Celery worker's outbox bridge")
        finally:
            client.close()
        return self

    def _bridge_reading(self, client: redis.Redis) -> bool:
        assert self.process is not None
        if self.process.poll() is not None:
            raise AssertionError(f"celery exited: {self.log()}")
        try:
            consumers = client.xinfo_consumers(keys.OUTBOX_STREAM, keys.OUTBOX_GROUP)
        except redis.ResponseError:
            return False
        return bool(consumers)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def __enter__(self) -> "CeleryWorker":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


@pytest.fixture
def celery_worker(hook_settings: ServiceSettings, tmp_path: Path) -> Iterator[CeleryWorker]:
    worker = CeleryWorker(hook_settings, tmp_path / "celery.log").start()
    yield worker
    worker.stop()


@dataclass
class Delivery:
    path: str
    headers: dict[str, str]
    body: bytes
    status_code: int  # what the receiver answered

    @property
    def json(self) -> Any:
        return json.loads(self.body)

    @property
    def event(self) -> str:
        return self.headers["specfleet-event"]


@dataclass
class Receiver:
    """A webhook receiver on 127.0.0.1: answers per path from `script` (then 200), records every call."""

    url: str
    secret: str
    script: dict[str, list[int]] = field(default_factory=dict)
    calls: list[Delivery] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def answer(self, path: str) -> int:
        with self.lock:
            codes = self.script.get(path)
            return codes.pop(0) if codes else 200

    def record(self, delivery: Delivery) -> None:
        with self.lock:
            self.calls.append(delivery)

    def received(self, path: str | None = None, status_code: int | None = None) -> list[Delivery]:
        with self.lock:
            return [
                c
                for c in self.calls
                if (path is None or c.path == path) and (status_code is None or c.status_code == status_code)
            ]

    def wait_for(
        self, condition: Callable[[list[Delivery]], bool], timeout_s: float = 30, what: str = ""
    ) -> list[Delivery]:
        return wait_until(
            lambda: condition(self.received()) and self.received(),
            timeout_s,
            0.02,
            what or "webhook deliveries",
        )

    def verify_all(self) -> None:
        for call in self.received():
            verify(self.secret, call.headers, call.body)


@pytest.fixture
def receiver(hook_settings: ServiceSettings) -> Iterator[Receiver]:
    port = free_port()
    state = Receiver(url=f"http://127.0.0.1:{port}", secret=hook_settings.webhook_secret.get_secret_value())

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802
            body = self.rfile.read(int(self.headers.get("content-length") or 0))
            code = state.answer(self.path)
            state.record(Delivery(self.path, {k.lower(): v for k, v in self.headers.items()}, body, code))
            self.send_response(code)
            if code == 503:
                self.send_header("Retry-After", "0")
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002
            pass

    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield state
    server.shutdown()
    server.server_close()
    thread.join(5)
