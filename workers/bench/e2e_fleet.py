"""The fleet under benchmark: a private redis-server, a gateway (uvicorn subprocess) and a worker (subprocess),
started the way the tests and `specfleet up` start them, and stopped in order (gateway, worker, Redis)."""

import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType

import httpx
import redis

from shared import keys
from shared.api_keys import KeyRegistry
from shared.procs import die_with_parent
from shared.redis_server import RedisServer, free_port
from workers.bench.http_client import Endpoint, cpu_seconds

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[2]
READY_TIMEOUT_S = 120.0
# quick liveness and an idle worker that wakes at once on a new queue entry (XREAD BLOCK)
FLEET_ENV = {"SPECFLEET_IDLE_BLOCK_MS": "200", "SPECFLEET_HEARTBEAT_INTERVAL_S": "1"}


class BenchFleet:
    """`with BenchFleet(tmp, target, draft, ...) as fleet:` fleet.url, fleet.redis_url; start_worker()/stop_worker()."""

    def __init__(
        self,
        work_dir: Path,
        target_dir: Path,
        draft_dir: Path | None,
        *,
        num_gateway_procs: int = 1,
        num_engine_threads: int = 1,
        max_num_seqs: int = 32,
    ) -> None:
        self.work_dir = work_dir
        self.target_dir, self.draft_dir = target_dir, draft_dir
        self.num_gateway_procs = num_gateway_procs
        self.num_engine_threads = num_engine_threads
        self.max_num_seqs = max_num_seqs
        self.redis_server = RedisServer(work_dir / "redis", appendonly=True)  # as `specfleet up` runs it
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.gateway: subprocess.Popen[bytes] | None = None
        self.worker: subprocess.Popen[bytes] | None = None
        self.api_key = ""

    @property
    def redis_url(self) -> str:
        return self.redis_server.url

    @property
    def endpoint(self) -> Endpoint:
        """The gateway, with this run's API key on every request."""
        return Endpoint("127.0.0.1", self.port, (("Authorization", f"Bearer {self.api_key}"),))

    def reset_data(self) -> None:
        """Empty Redis between phases (jobs, queues, keys), then a fresh API key without limits: the benchmark
        measures the fleet, not a tenant's rate limit."""
        client = redis.Redis.from_url(self.redis_url, decode_responses=True)
        try:
            client.flushall()
            _, self.api_key = KeyRegistry(client).create(
                "bench", requests_per_min=0, tokens_per_min=0, max_concurrent_jobs=0
            )
        finally:
            client.close()

    def _env(self) -> dict[str, str]:
        return {**os.environ, **FLEET_ENV, "REDIS_URL": self.redis_url}

    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen[bytes]:
        with open(self.work_dir / f"{name}.log", "wb") as out:
            return subprocess.Popen(
                [sys.executable, "-m", "shared.cli", *args],
                cwd=ROOT,
                env=self._env(),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                preexec_fn=die_with_parent,
            )

    def start(self) -> "BenchFleet":
        self.redis_server.start()
        self.reset_data()
        self.start_gateway(self.num_gateway_procs)
        return self

    def start_gateway(self, num_procs: int) -> None:
        """(Re)start the gateway with `num_procs` uvicorn processes (access log off, as a loaded gateway runs);
        nothing to do when it already runs with that many."""
        if self.gateway is not None and self.gateway.poll() is None and num_procs == self.num_gateway_procs:
            return
        self.stop_gateway()
        self.num_gateway_procs = num_procs
        args = ["gateway", "--port", str(self.port), "--workers", str(num_procs), "--no-access-log"]
        self.gateway = self._spawn("gateway", args)
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            self._check(self.gateway, "gateway")
            try:
                if httpx.get(f"{self.url}/healthz", timeout=1.0).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the gateway did not answer at {self.url}")
            time.sleep(0.05)

    def stop_gateway(self) -> None:
        if self.gateway is not None:
            _terminate(self.gateway)
            self.gateway = None

    def start_worker(self) -> None:
        args = [
            "worker",
            "--target",
            str(self.target_dir),
            "--num-threads",
            str(self.num_engine_threads),
            "--max-num-seqs",
            str(self.max_num_seqs),
            "--name",
            "bench-worker",
        ]
        if self.draft_dir is not None:
            args += ["--draft", str(self.draft_dir)]
        self.worker = self._spawn("worker", args)
        client = redis.Redis.from_url(self.redis_url)
        deadline = time.monotonic() + READY_TIMEOUT_S
        try:
            while client.zscore(keys.WORKERS_ZSET, "bench-worker") is None:
                self._check(self.worker, "worker")
                if time.monotonic() > deadline:
                    raise RuntimeError("the worker did not come up")
                time.sleep(0.05)
        finally:
            client.close()

    def _check(self, proc: subprocess.Popen[bytes], name: str) -> None:
        if proc.poll() is not None:
            tail = (self.work_dir / f"{name}.log").read_text(errors="replace")[-3000:]
            raise RuntimeError(f"the {name} exited with status {proc.returncode}:\n{tail}")

    def gateway_pids(self) -> list[int]:
        """The gateway process and, with several workers, its children (uvicorn's worker processes)."""
        assert self.gateway is not None
        pids = [self.gateway.pid]
        children = Path(f"/proc/{self.gateway.pid}/task/{self.gateway.pid}/children")
        if children.exists():
            pids += [int(p) for p in children.read_text().split()]
        return pids

    def cpu_seconds(self) -> dict[str, float]:
        """CPU seconds used so far by the gateway processes, Redis and the worker."""
        out = {"gateway": sum(cpu_seconds(pid) for pid in self.gateway_pids())}
        if self.redis_server.process is not None:
            out["redis"] = cpu_seconds(self.redis_server.process.pid)
        if self.worker is not None and self.worker.poll() is None:
            out["worker"] = cpu_seconds(self.worker.pid)
        return out

    def stop(self) -> None:
        """Gateway, then worker, then Redis."""
        self.stop_gateway()
        if self.worker is not None:
            _terminate(self.worker)
        self.redis_server.stop()

    def __enter__(self) -> "BenchFleet":
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def _terminate(proc: subprocess.Popen[bytes], timeout_s: float = 30.0) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            log.warning("pid %d did not stop; killing it", proc.pid)
            proc.kill()
            proc.wait()
