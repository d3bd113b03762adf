"""The one fleet launcher of `specfleet up` and `specfleet bench e2e`: a Redis (private redis-server, AOF on,
unless a URL is given), then the Celery worker, the engine worker and the gateway as `specfleet` subprocesses;
stopped gateway first, then the worker (it hands unfinished jobs back), the Celery worker, Redis last.

Each side is started by its command line, so this module imports neither gateway/ nor workers/; the caller
resolves the models first. With a CPU placement (shared/cpu_placement.py), Redis, the Celery worker and the
gateway start bound to its I/O cores and the worker is told its engine cores (SPECFLEET_ENGINE_CPUS). Children
run in their own process groups (a terminal's Ctrl-C reaches only the launcher, which stops them in order) and
get SIGTERM if the launcher dies anyway (PR_SET_PDEATHSIG).
"""

import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType

import httpx
import redis

from shared import cpu_placement, keys
from shared import redis_url as redis_urls
from shared.cpu_placement import Placement
from shared.procs import die_with_parent
from shared.redis_server import RedisServer, free_port

log = logging.getLogger(__name__)

STOP_ORDER = ("gateway", "worker", "celery")  # by role; Redis after them
STOP_TIMEOUT_S = 30.0
LOG_TAIL_CHARS = 3000
# the private redis-server is started again when it exits (killed, out of memory), on its port and its data
# directory: up to this many times within REDIS_RESTART_WINDOW_S; one more exit stops the fleet
REDIS_RESTARTS_MAX = 3
REDIS_RESTART_WINDOW_S = 60.0


class Fleet:
    """`with Fleet(redis_dir) as fleet:` start_celery(), start_worker(args), start_gateway(); fleet.url.

    redis_url: use that Redis (nothing to start); else a private redis-server under redis_dir.
    log_dir: each child's output goes to <log_dir>/<role>.log (its tail is in the error when it exits);
    None: children write to this process's stdout/stderr.
    placement: which cores run the engine and which the I/O (cpu_placement.for_fleet); None: not bound.
    """

    def __init__(
        self,
        redis_dir: Path,
        *,
        redis_url: str | None = None,
        appendonly: bool = True,
        host: str = "127.0.0.1",
        port: int = 0,
        env: dict[str, str] | None = None,
        log_dir: Path | None = None,
        cwd: Path | None = None,
        ready_poll_s: float = 0.1,
        placement: Placement | None = None,
    ) -> None:
        self.redis_dir = redis_dir
        self.external_redis_url = redis_url
        self.appendonly = appendonly
        self.host = host
        self.port = port or free_port()
        self.extra_env = env or {}
        self.log_dir = log_dir
        self.cwd = cwd
        self.ready_poll_s = ready_poll_s
        self.placement = placement
        if placement is not None:
            log.info("cpu placement: %s", placement.describe())
        self.redis_server: RedisServer | None = None
        self.redis_exits_s: list[float] = []  # when the private redis-server exited (monotonic), in the window
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.num_gateway_procs = 0
        self.stop_requested = False  # set from a signal handler: every wait gives up

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def redis_url(self) -> str:
        if self.redis_server is not None:
            return self.redis_server.url
        if self.external_redis_url is None:
            raise RuntimeError("Redis is not started")
        return self.external_redis_url

    # -- start -------------------------------------------------------------------------------------------
    def start_redis(self) -> str:
        if self.external_redis_url:
            log.info("using the Redis at %s", self.external_redis_url)
        else:
            io_cpus = self.placement.io_cpus if self.placement else None
            self.redis_server = RedisServer(self.redis_dir, appendonly=self.appendonly, cpus=io_cpus).start()
        return self.redis_url

    def start_celery(self) -> None:
        self._spawn("celery", ["tasks"])

    def start_worker(self, args: list[str], name: str | None = None, timeout_s: float = 900.0) -> None:
        """`specfleet worker <args> [--name NAME]`; returns once it heartbeats (by NAME, else any worker)."""
        self._spawn("worker", ["worker", *args, *(["--name", name] if name else [])])
        client = redis_urls.client(self.redis_url)
        deadline = time.monotonic() + timeout_s
        try:
            while not _is_heartbeating(client, name):
                self.check_children()
                if time.monotonic() > deadline or self.stop_requested:
                    raise RuntimeError("the worker did not come up")
                time.sleep(self.ready_poll_s)
        finally:
            client.close()

    def start_gateway(self, num_procs: int | None = None, access_log: bool = True, timeout_s: float = 60.0) -> None:
        """`specfleet gateway --port P` (with --workers N / --no-access-log when asked); returns once /healthz
        answers. Nothing to do when it already runs with that many processes."""
        running = self.procs.get("gateway")
        if running is not None and running.poll() is None and (num_procs or 1) == self.num_gateway_procs:
            return
        self.stop_role("gateway")
        args = ["gateway", "--port", str(self.port)]
        if num_procs is not None:
            args += ["--workers", str(num_procs)]
        if not access_log:
            args.append("--no-access-log")
        self.num_gateway_procs = num_procs or 1
        self._spawn("gateway", args)
        deadline = time.monotonic() + timeout_s
        while True:
            self.check_children()
            try:
                if httpx.get(f"{self.url}/healthz", timeout=1.0).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline or self.stop_requested:
                raise RuntimeError(f"the gateway did not answer at {self.url}")
            time.sleep(self.ready_poll_s)

    def _spawn(self, role: str, args: list[str]) -> None:
        env = {**os.environ, **self.extra_env, "REDIS_URL": self.redis_url}
        preexec = die_with_parent
        if self.placement is not None:
            cpus = self.placement.io_cpus
            if role == "worker":  # all the placement's cores: it binds its engine and its helpers itself
                cpus = self.placement.engine_cpus | self.placement.io_cpus
                env["SPECFLEET_ENGINE_CPUS"] = cpu_placement.format_cpu_list(self.placement.engine_cpus)
            preexec = cpu_placement.binder(cpus, die_with_parent)
        command = [sys.executable, "-m", "shared.cli", *args]
        options = {"cwd": self.cwd, "env": env, "stdin": subprocess.DEVNULL, "start_new_session": True}
        if self.log_dir is None:
            process = subprocess.Popen(command, preexec_fn=preexec, **options)  # type: ignore[call-overload]
        else:
            with open(self.log_dir / f"{role}.log", "wb") as out:
                process = subprocess.Popen(  # type: ignore[call-overload]
                    command, stdout=out, stderr=subprocess.STDOUT, preexec_fn=preexec, **options
                )
        self.procs[role] = process
        log.info("started %s (pid %d)", role, process.pid)

    # -- watch -------------------------------------------------------------------------------------------
    def check_children(self) -> None:
        """RuntimeError naming the first child that exited (with its log's tail when it has one); a private
        redis-server that exited is started again first (`_restart_redis`)."""
        self._restart_redis()
        for role, process in self.procs.items():
            if process.poll() is not None:
                message = f"the {role} exited with status {process.returncode}"
                if self.log_dir is not None:
                    message += ":\n" + (self.log_dir / f"{role}.log").read_text(errors="replace")[-LOG_TAIL_CHARS:]
                raise RuntimeError(message)

    def _restart_redis(self) -> None:
        """The private redis-server exited: start it again on the same port and data directory. Its AOF holds
        every job written up to a second before (appendfsync everysec), and the other processes reconnect on
        their own (a worker drops what it held and resumes it from the last token written). RuntimeError once it
        exited more than REDIS_RESTARTS_MAX times within REDIS_RESTART_WINDOW_S, or when it does not start."""
        server = self.redis_server
        if server is None or server.process is None or server.process.poll() is None:
            return
        status = server.process.returncode
        now_s = time.monotonic()
        self.redis_exits_s = [t for t in self.redis_exits_s if now_s - t < REDIS_RESTART_WINDOW_S] + [now_s]
        if len(self.redis_exits_s) > REDIS_RESTARTS_MAX:
            log_path = server.data_dir / "redis.log"
            tail = log_path.read_text(errors="replace")[-LOG_TAIL_CHARS:] if log_path.exists() else ""
            raise RuntimeError(
                f"the private redis-server exited {len(self.redis_exits_s)} times within "
                f"{REDIS_RESTART_WINDOW_S:.0f} s (last status {status}):\n{tail}"
            )
        log.warning("the private redis-server exited with status %s; starting it again at %s", status, server.url)
        try:
            server.start()
        except (RuntimeError, TimeoutError, OSError) as exc:
            raise RuntimeError(f"the private redis-server exited (status {status}) and did not start again: {exc}") from exc

    def pid(self, role: str) -> int | None:
        process = self.procs.get(role)
        return process.pid if process is not None and process.poll() is None else None

    # -- stop --------------------------------------------------------------------------------------------
    def stop_role(self, role: str) -> None:
        process = self.procs.pop(role, None)
        if process is None or process.poll() is not None:
            return
        process.terminate()
        try:
            process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            log.warning("%s (pid %d) did not stop; killing it", role, process.pid)
            process.kill()
            process.wait()

    def stop(self) -> None:
        """Gateway first (no new jobs), then the worker (hands jobs back), the Celery worker (unfinished tasks
        stay in Redis: acks_late), then Redis (flushes its AOF)."""
        for role in STOP_ORDER:
            self.stop_role(role)
        if self.redis_server is not None:
            self.redis_server.stop()
            self.redis_server = None

    def __enter__(self) -> "Fleet":
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def _is_heartbeating(client: redis.Redis, name: str | None) -> bool:
    if name is None:
        return int(client.zcard(keys.WORKERS_ZSET)) > 0
    return client.zscore(keys.WORKERS_ZSET, name) is not None
