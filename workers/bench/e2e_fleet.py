"""The fleet under benchmark: the launcher of `specfleet up` (shared/fleet.py) with a private redis-server
(AOF on, as `specfleet up` runs it), a gateway and a worker, each child's output in a log file; plus what the
benchmark reads of it: an API key without limits, the processes' CPU time."""

import logging
import os
from pathlib import Path

from shared import cpu_placement
from shared import redis_url as redis_urls
from shared.api_keys import KeyRegistry
from shared.fleet import Fleet
from shared.procs import ProcessGroup
from shared.settings import ServiceSettings
from workers.bench.http_client import Endpoint, cpu_seconds

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[2]
READY_TIMEOUT_S = 120.0
READY_POLL_S = 0.05
WORKER_NAME = "bench-worker"
# quick liveness and an idle worker that wakes at once on a new queue entry (XREAD BLOCK)
FLEET_ENV = {"SPECFLEET_IDLE_BLOCK_MS": "200", "SPECFLEET_HEARTBEAT_INTERVAL_S": "1"}


class BenchFleet(ProcessGroup):
    """`with BenchFleet(tmp, target, draft, ...) as fleet:` fleet.url, fleet.redis_url; start_worker()."""

    def __init__(
        self,
        work_dir: Path,
        target_dir: Path,
        draft_dir: Path | None,
        *,
        num_gateway_procs: int = 1,
        num_engine_threads: int = 1,
        max_num_seqs: int = 32,
        env: dict[str, str] | None = None,  # more environment for every process (settings of a phase)
        eagle_dir: Path | None = None,  # the target's EAGLE head (the demo target's, as `specfleet up` runs it)
    ) -> None:
        self.target_dir, self.draft_dir, self.eagle_dir = target_dir, draft_dir, eagle_dir
        self.num_engine_threads = num_engine_threads
        self.max_num_seqs = max_num_seqs
        self.initial_gateway_procs = num_gateway_procs
        work_dir.mkdir(parents=True, exist_ok=True)
        # as `specfleet up` places them: the engine's cores, the I/O's (Redis, gateway, Celery, writer, client)
        self.placement = cpu_placement.for_fleet(ServiceSettings())
        self.fleet = Fleet(
            work_dir / "redis", appendonly=True, env={**FLEET_ENV, **(env or {})}, log_dir=work_dir, cwd=ROOT,
            ready_poll_s=READY_POLL_S, placement=self.placement,
        )
        self.port = self.fleet.port
        self.url = self.fleet.url
        self.api_key = ""
        # the processes' redis_partitions (their environment: shared/fleet.py), where a new key's record must go
        children_env = {**os.environ, **FLEET_ENV, **(env or {})}
        self.num_partitions = int(children_env.get("SPECFLEET_REDIS_PARTITIONS", "1"))
        metrics_port = int(children_env.get("SPECFLEET_WORKER_METRICS_PORT", "0") or 0)
        # the worker's /metrics when it serves them on a known port (the loop's parts: workers/bench/e2e_loop.py)
        self.worker_metrics_url = f"http://127.0.0.1:{metrics_port}/metrics" if metrics_port else None

    @property
    def redis_url(self) -> str:
        return self.fleet.redis_url

    @property
    def num_gateway_procs(self) -> int:
        return self.fleet.num_gateway_procs

    @property
    def endpoint(self) -> Endpoint:
        """The gateway, with this run's API key on every request."""
        return Endpoint("127.0.0.1", self.port, (("Authorization", f"Bearer {self.api_key}"),))

    def reset_data(self) -> None:
        """Empty Redis between phases (jobs, queues, keys), then a fresh API key without limits: the benchmark
        measures the fleet, not a tenant's rate limit."""
        client = redis_urls.client(self.redis_url, decode_responses=True)
        try:
            client.flushall()
        finally:
            client.close()
        self.api_key = self._new_key("bench")

    def tenant_endpoint(self, name: str) -> Endpoint:
        """The gateway with a new API key of its own (a tenant), without limits."""
        return Endpoint("127.0.0.1", self.port, (("Authorization", f"Bearer {self._new_key(name)}"),))

    def admin_headers(self) -> tuple[tuple[str, str], ...]:
        """A new admin key's header (what the gateway's /metrics asks for)."""
        return (("Authorization", f"Bearer {self._new_key('bench-admin', is_admin=True)}"),)

    def _new_key(self, name: str, is_admin: bool = False) -> str:
        """A new API key without limits -> its secret."""
        client = redis_urls.client(self.redis_url, decode_responses=True)
        try:
            _, secret = KeyRegistry(client, self.num_partitions).create(
                name, requests_per_min=0, tokens_per_min=0, max_concurrent_jobs=0, is_admin=is_admin
            )
        finally:
            client.close()
        return secret

    def start_celery(self) -> None:
        """The Celery worker (batch expansion, webhooks), as `specfleet up` runs it."""
        if "celery" not in self.fleet.procs:
            self.fleet.start_celery()

    def start(self) -> "BenchFleet":
        """Redis, the gateway and the Celery worker (the worker comes per phase): every phase measures the fleet
        `specfleet up` runs, whose Celery worker shares the I/O cores."""
        self.fleet.start_redis()
        self.reset_data()
        self.start_gateway(self.initial_gateway_procs)
        self.start_celery()
        return self

    def start_gateway(self, num_procs: int) -> None:
        """(Re)start the gateway with `num_procs` uvicorn processes (access log off, as a loaded gateway runs);
        nothing to do when it already runs with that many."""
        self.fleet.start_gateway(num_procs, access_log=False, timeout_s=READY_TIMEOUT_S)

    def stop_gateway(self) -> None:
        self.fleet.stop_role("gateway")

    def start_worker(self, max_num_seqs: int | None = None) -> None:
        """Start the worker (restart it, when one runs), with the fleet's slots unless `max_num_seqs`."""
        self.stop_worker()
        args = ["--target", str(self.target_dir), "--num-threads", str(self.num_engine_threads),
                "--max-num-seqs", str(max_num_seqs or self.max_num_seqs)]  # fmt: skip
        if self.draft_dir is not None:
            args += ["--draft", str(self.draft_dir)]
        if self.eagle_dir is not None:
            args += ["--eagle", str(self.eagle_dir)]
        self.fleet.start_worker(args, name=WORKER_NAME, timeout_s=READY_TIMEOUT_S)

    def stop_worker(self) -> None:
        self.fleet.stop_role("worker")

    def gateway_pids(self) -> list[int]:
        """The gateway process and, with several workers, its children (uvicorn's worker processes)."""
        pid = self.fleet.pid("gateway")
        assert pid is not None
        return [pid, *children_of(pid)]

    def cpu_seconds(self) -> dict[str, float]:
        """CPU seconds used so far by the gateway processes, Redis, the worker (its loop, engine and threads), the
        worker's child processes (`writer`: its writer process, and tensor-parallel ranks if any) and the Celery
        worker (`celery`: its process and pool)."""
        out = {"gateway": sum(cpu_seconds(pid) for pid in self.gateway_pids())}
        server = self.fleet.redis_server
        if server is not None and server.process is not None:
            out["redis"] = cpu_seconds(server.process.pid)
        worker_pid = self.fleet.pid("worker")
        if worker_pid is not None:
            out["worker"] = cpu_seconds(worker_pid)
            out["writer"] = sum(cpu_seconds(pid) for pid in children_of(worker_pid))
        celery_pid = self.fleet.pid("celery")
        if celery_pid is not None:
            out["celery"] = sum(cpu_seconds(pid) for pid in (celery_pid, *children_of(celery_pid)))
        return out

    def stop(self) -> None:
        """Gateway, then worker, then the Celery worker, then Redis."""
        self.fleet.stop()


def children_of(pid: int) -> list[int]:
    """The live child processes of `pid` (one level), from /proc; a child that exits meanwhile is left out."""
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            found += [int(child) for child in (task / "children").read_text().split()]
        except OSError:
            continue
    return [child for child in found if Path(f"/proc/{child}").exists()]
