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
