"""`specfleet up`: the embedded default in one command, stopped in order with no orphan process.

    private redis-server (AOF on; skipped when REDIS_URL is set) -> demo models (built if missing)
    -> the Celery worker (webhooks, batches) -> one worker -> the gateway; then print the URL and wait.

Ctrl-C / SIGTERM stops the gateway, then the worker (it hands unfinished jobs back to the queue), then the
Celery worker (unfinished tasks stay in Redis: acks_late), then Redis.
Children run in their own process groups (so a terminal's Ctrl-C reaches only this process, which stops them
in that order) and get SIGTERM if this process dies anyway (PR_SET_PDEATHSIG).
"""

import logging
import os
import signal
import subprocess
import sys
import time
from types import FrameType

import httpx
import redis
import typer

from shared import keys
from shared.procs import die_with_parent
from shared.redis_server import RedisServer, free_port
from shared.settings import ServiceSettings, get_settings

log = logging.getLogger(__name__)

WORKER_READY_TIMEOUT_S = 900.0  # a first demo-model build takes minutes
GATEWAY_READY_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 30.0


class Fleet:
    def __init__(
        self,
        port: int | None = None,
        target: str | None = None,
        draft: str | None = None,
        settings: ServiceSettings | None = None,
    ) -> None:
        self.settings = settings or get_settings()
        self.port = self.settings.port if port is None else (port or free_port())
        self.target = target
        self.draft = draft
        self.redis_server: RedisServer | None = None
        self.children: list[tuple[str, subprocess.Popen[bytes]]] = []
        self._stop_requested = False

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._on_signal)
        try:
            redis_url = self._start_redis()
            env = {**os.environ, "REDIS_URL": redis_url}
            self._ensure_models()
            self._spawn("celery", ["tasks"], env)
            self._spawn("worker", self._worker_args(), env)
            self._wait_for_worker(redis_url)
            self._spawn("gateway", ["gateway", "--port", str(self.port)], env)
            url = f"http://{self.settings.host}:{self.port}"
            self._wait_for_gateway(url)
            api_key = self._dev_key(redis_url) if self.settings.env == "dev" else None
            self._announce(url, api_key)
            return self._supervise()
        except KeyboardInterrupt:
            return 0
        except RuntimeError as exc:
            typer.echo(f"specfleet: {exc}", err=True)
            return 1
        finally:
            self.stop()

    # -- steps -----------------------------------------------------------------------------------------
    def _start_redis(self) -> str:
        if self.settings.redis_url:
            log.info("using the Redis at %s", self.settings.redis_url)
            return self.settings.redis_url
        self.redis_server = RedisServer(self.settings.redis_dir).start()
        return self.redis_server.url

    def _ensure_models(self) -> None:
        if self.target is not None:
            return
        from workers.engine.config import EngineConfig

        if EngineConfig.load(self.settings.engine_config).target_dir is not None:
            return
        try:
            from workers.demo.build import ensure_demo_pair
        except ImportError as exc:
            raise RuntimeError(
                "the demo model builder is not available; pass --target DIR [--draft DIR]"
            ) from exc
        typer.echo("specfleet: preparing the demo models (built once, a few minutes)...")
        ensure_demo_pair()

    def _worker_args(self) -> list[str]:
        args = ["worker"]
        if self.target:
            args += ["--target", self.target]
        if self.draft:
            args += ["--draft", self.draft]
        return args

    def _spawn(self, name: str, args: list[str], env: dict[str, str]) -> None:
        process = subprocess.Popen(
            [sys.executable, "-m", "shared.cli", *args],
            env=env,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=die_with_parent,
        )
        self.children.append((name, process))
        log.info("started %s (pid %d)", name, process.pid)

    def _check_children(self) -> None:
        for name, process in self.children:
            if process.poll() is not None:
                raise RuntimeError(f"the {name} exited with status {process.returncode}")

    def _wait_for_worker(self, redis_url: str) -> None:
        client = redis.Redis.from_url(redis_url)
        deadline = time.monotonic() + WORKER_READY_TIMEOUT_S
        try:
            while client.zcard(keys.WORKERS_ZSET) == 0:
                self._check_children()
                if time.monotonic() > deadline or self._stop_requested:
                    raise RuntimeError("the worker did not come up")
                time.sleep(0.1)
        finally:
            client.close()

    def _wait_for_gateway(self, url: str) -> None:
        deadline = time.monotonic() + GATEWAY_READY_TIMEOUT_S
        while True:
            self._check_children()
            try:
                if httpx.get(f"{url}/healthz", timeout=1.0).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline or self._stop_requested:
                raise RuntimeError(f"the gateway did not answer at {url}")
            time.sleep(0.1)

    def _dev_key(self, redis_url: str) -> str:
        """Dev mode: a fresh admin key for this run (printed; stored hashed like any other)."""
        from shared.api_keys import KeyRegistry

        client = redis.Redis.from_url(redis_url, decode_responses=True)
        try:
            _, secret = KeyRegistry(client).create(
                "dev",
                requests_per_min=self.settings.default_requests_per_min,
                tokens_per_min=self.settings.default_tokens_per_min,
                max_concurrent_jobs=self.settings.default_max_concurrent_jobs,
                is_admin=True,
                webhook_secret=self.settings.webhook_secret.get_secret_value(),
            )
        finally:
            client.close()
        return secret

    def _announce(self, url: str, api_key: str | None) -> None:
        if api_key:  # before the URL: whoever waits for the URL line has the key too
            typer.echo(f"specfleet: api key {api_key}")
        typer.echo(f"specfleet: gateway at {url}")
        typer.echo(
            f"specfleet: redis at {self.redis_server.url if self.redis_server else self.settings.redis_url}"
        )
        typer.echo(
            "specfleet: try  curl -s -X POST "
            f"{url}/v1/jobs -H 'Authorization: Bearer {api_key or '$SPECFLEET_API_KEY'}' "
            "-H 'Content-Type: application/json' -H 'Prefer: wait=30' "
            """-d '{"prompt": "def fib(n):", "max_tokens": 64, "temperature": 0}'"""
        )
        typer.echo(
            f"specfleet: or   SPECFLEET_API_KEY={api_key or '...'} "
            f"python -m shared.cli submit 'def fib(n):' --stream --url {url}"
        )
        typer.echo("specfleet: Ctrl-C stops everything")

    def _supervise(self) -> int:
        while not self._stop_requested:
            try:
                self._check_children()
            except RuntimeError as exc:
                typer.echo(f"specfleet: {exc}; stopping", err=True)
                return 1
            time.sleep(0.2)
        return 0

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._stop_requested = True

    def stop(self) -> None:
        """Gateway first (no new jobs), then the worker (hands jobs back), then Redis (flushes its AOF)."""
        for name, process in reversed(self.children):
            if process.poll() is None:
                process.terminate()
                try:
                    process.wait(STOP_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    log.warning("%s (pid %d) did not stop; killing it", name, process.pid)
                    process.kill()
                    process.wait()
        self.children.clear()
        if self.redis_server is not None:
            self.redis_server.stop()
            self.redis_server = None
