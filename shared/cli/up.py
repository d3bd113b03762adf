"""`specfleet up`: the embedded default in one command, stopped in order with no orphan process.

    private redis-server (AOF on; skipped when REDIS_URL is set) -> demo models (built if missing)
    -> the Celery worker (webhooks, batches) -> one worker -> the gateway; then print the URL and wait.
    On a host of 2+ cores the engine gets cores of its own, the rest the I/O (shared/cpu_placement.py).

Ctrl-C / SIGTERM stops the gateway, then the worker (it hands unfinished jobs back to the queue), then the
Celery worker (unfinished tasks stay in Redis: acks_late), then Redis: the launcher, shared/fleet.py.
"""

import errno
import os
import signal
import socket
import time
from types import FrameType

import typer

from shared import cpu_placement
from shared import redis_url as redis_urls
from shared.fleet import Fleet
from shared.settings import ServiceSettings, get_settings

WORKER_READY_TIMEOUT_S = 900.0  # a first demo-model build takes minutes
GATEWAY_READY_TIMEOUT_S = 60.0
SUPERVISE_POLL_S = 0.2
DEV_KEY_FILE = "dev-key"  # under redis_dir: the dev admin key's secret, reused while its Redis holds it


class Up:
    def __init__(
        self,
        port: int | None = None,
        target: str | None = None,
        draft: str | None = None,
        settings: ServiceSettings | None = None,
        model_version: str | None = None,
    ) -> None:
        self.settings = settings or get_settings()
        self.model_version = model_version
        self.target = target
        self.draft = draft
        self.fleet = Fleet(
            self.settings.redis_dir,
            redis_url=self.settings.redis_url,
            host=self.settings.host,
            port=self.settings.port if port is None else port,
            placement=cpu_placement.for_fleet(self.settings),  # ValueError: engine_cpus none of ours
        )

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._on_signal)
        try:
            self._check_port()
            redis_url = self.fleet.start_redis()
            self._ensure_models()
            self.fleet.start_celery()
            self.fleet.start_worker(self._worker_args(), timeout_s=WORKER_READY_TIMEOUT_S)
            self.fleet.start_gateway(timeout_s=GATEWAY_READY_TIMEOUT_S)
            api_key = self._dev_key(redis_url) if self.settings.env == "dev" else None
            self._announce(self.fleet.url, redis_url, api_key)
            return self._supervise()
        except KeyboardInterrupt:
            return 0
        except RuntimeError as exc:
            typer.echo(f"specfleet: {exc}", err=True)
            return 1
        finally:
            self.fleet.stop()

    def _check_port(self) -> None:
        """The gateway's address, free before anything starts: taken, the gateway failed only after Redis, the
        models and the worker had started (~30 s). SO_REUSEADDR as uvicorn binds, so a closing socket passes."""
        host, port = self.fleet.host, self.fleet.port
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((host, port))
            except OSError as exc:
                if exc.errno != errno.EADDRINUSE:
                    raise RuntimeError(f"cannot serve on {host}:{port}: {exc.strerror}") from exc
                raise RuntimeError(f"port {port} on {host} is in use (another fleet?): --port N picks another") from exc

    def _ensure_models(self) -> None:
        """Build the demo pair here (once, minutes) when no model is named, so the worker finds it cached."""
        if self.target is not None:
            return
        from workers.engine.config import EngineConfig

        if EngineConfig.load(self.settings.engine_config).target_dir is not None:
            return
        try:
            from workers.demo.build import ensure_demo_pair
            from workers.demo.eagle_build import ensure_demo_head
        except ImportError as exc:
            raise RuntimeError(
                "the demo model builder is not available; pass --target DIR [--draft DIR]"
            ) from exc
        typer.echo("specfleet: preparing the demo models (built once, a few minutes)...")
        ensure_demo_head(ensure_demo_pair())

    def _worker_args(self) -> list[str]:
        args = []
        if self.target:
            args += ["--target", self.target]
        if self.draft:
            args += ["--draft", self.draft]
        if self.model_version:
            args += ["--model-version", self.model_version]
        return args

    def _dev_key(self, redis_url: str) -> str:
        """Dev mode: the admin key of the last run when its Redis still holds it active (its secret kept beside
        the Redis data, DEV_KEY_FILE, owner-only), else a new one (printed; stored hashed like any other). Each
        run minted another, and the earlier ones stayed valid."""
        from shared.api_keys import KeyRegistry, digest, key_of_digest

        kept = self.settings.redis_dir / DEV_KEY_FILE
        client = redis_urls.client(redis_url, decode_responses=True)
        try:
            if kept.exists():
                secret = kept.read_text().strip()
                key = key_of_digest(client, digest(secret), self.settings.redis_partitions)
                if key is not None and key.is_active and key.is_admin:
                    return secret
            _, secret = KeyRegistry(client, self.settings.redis_partitions).create(
                "dev",
                requests_per_min=self.settings.default_requests_per_min,
                tokens_per_min=self.settings.default_tokens_per_min,
                max_concurrent_jobs=self.settings.default_max_concurrent_jobs,
                is_admin=True,
                webhook_secret=self.settings.webhook_secret.get_secret_value(),
            )
        finally:
            client.close()
        kept.parent.mkdir(parents=True, exist_ok=True)
        descriptor = os.open(kept, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(descriptor, "w") as out:
            out.write(secret + "\n")
        return secret

    def _announce(self, url: str, redis_url: str, api_key: str | None) -> None:
        if api_key:  # before the URL: whoever waits for the URL line has the key too
            typer.echo(f"specfleet: api key {api_key}")
        typer.echo(f"specfleet: gateway at {url}")
        typer.echo(f"specfleet: redis at {redis_url}")
        typer.echo(
            "specfleet: try  curl -s -X POST "
            f"{url}/v1/jobs -H 'Authorization: Bearer {api_key or '$SPECFLEET_API_KEY'}' "
            "-H 'Content-Type: application/json' -H 'Prefer: wait=30' "
            """-d '{"prompt": "def fib(n):", "max_tokens": 64, "temperature": 0}'"""
        )
        typer.echo(
            f"specfleet: or   SPECFLEET_API_KEY={api_key or '...'} "
            f"specfleet submit 'def fib(n):' --stream --url {url}"
        )
        typer.echo("specfleet: Ctrl-C stops everything")

    def _supervise(self) -> int:
        while not self.fleet.stop_requested:
            try:
                self.fleet.check_children()
            except RuntimeError as exc:
                typer.echo(f"specfleet: {exc}; stopping", err=True)
                return 1
            time.sleep(SUPERVISE_POLL_S)
        return 0

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.fleet.stop_requested = True
