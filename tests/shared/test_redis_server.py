from pathlib import Path

import pytest
import redis

from shared.redis_server import RedisServer


def test_aof_survives_a_restart(tmp_path: Path) -> None:
    server = RedisServer(tmp_path).start()
    client = redis.Redis.from_url(server.url)
    try:
        assert client.config_get("appendonly") == {"appendonly": "yes"}
        client.set("k", "v")
    finally:
        client.close()
        server.stop()
    assert server.process is not None and server.process.returncode == 0
    with RedisServer(tmp_path) as again:
        client = redis.Redis.from_url(again.url)
        assert client.get("k") == b"v"
        client.close()


def test_one_server_a_data_directory(tmp_path: Path) -> None:
    """A second server on a directory in use refuses to start (both would append to one AOF); the directory is
    free again once the first stopped, and a server started again by its own object keeps it."""
    first = RedisServer(tmp_path, appendonly=False).start()
    try:
        with pytest.raises(RuntimeError, match="in use by another redis-server"):
            RedisServer(tmp_path, appendonly=False).start()
        assert first.process is not None
        first.process.kill()
        first.process.wait()
        first.start()  # a restart (shared/fleet.py's _restart_redis): the same object, the same directory
        client = redis.Redis.from_url(first.url)
        assert client.ping()
        client.close()
    finally:
        first.stop()
    with RedisServer(tmp_path, appendonly=False) as again:
        client = redis.Redis.from_url(again.url)
        assert client.ping()
        client.close()


def test_unix_socket(tmp_path: Path) -> None:
    with RedisServer(tmp_path, unix_socket=True, appendonly=False) as server:
        assert server.url.startswith("unix://")
        client = redis.Redis.from_url(server.url)
        assert client.ping()
        client.close()
    assert not server.socket_path.exists()


def test_bad_start_fails_with_the_log(tmp_path: Path) -> None:
    with RedisServer(tmp_path, appendonly=False) as first:
        with pytest.raises(RuntimeError, match="exited"):
            RedisServer(tmp_path / "b", port=first.port, appendonly=False).start()


def test_a_sentinel_groups_and_a_clusters_ports_are_all_distinct(tmp_path) -> None:
    """Ports are drawn before any process binds them, so free_port may hand one out twice: two sentinels of a
    group once drew the same port (one failed to start, and the group never formed in 60 s)."""
    from shared.redis_server import distinct_free_ports
    from shared.redis_topologies import LocalCluster, LocalSentinel

    ports = distinct_free_ports(50)
    assert len(set(ports)) == 50
    assert not set(distinct_free_ports(20, set(ports))) & set(ports)
    for _ in range(20):
        group = LocalSentinel(tmp_path / "s")
        assert len({group.master.port, group.replica_port, *group.sentinel_ports}) == 5
        cluster = LocalCluster(tmp_path / "c", num_masters=3)
        node_ports = [node.port for node in cluster.nodes]
        assert len({*node_ports, *(p + 10000 for p in node_ports)}) == 6
