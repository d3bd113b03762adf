"""shared/redis_url.py HeldConnection: a batch of commands in one write on a connection held for good, its replies
in order, against a real redis-server (and one that is restarted under it)."""

from pathlib import Path

import pytest
import redis

from shared import redis_url as redis_urls
from shared.redis_server import RedisServer, free_port
from shared.redis_topologies import LocalSentinel


def test_replies_in_order_with_a_failed_command_in_its_place(rclient: redis.Redis) -> None:
    held = redis_urls.HeldConnection(rclient)
    try:
        replies = held.execute([("SET", "held:a", "x"), ("INCR", "held:a"), ("APPEND", "held:a", "y"),
                                ("GET", "held:a")])  # fmt: skip
        again = held.execute([("GET", "held:a")])  # the failed INCR left nothing unread on the connection
    finally:
        held.close()
    assert replies[0] in ("OK", True)
    assert isinstance(replies[1], redis.ResponseError) and "not an integer" in str(replies[1])
    assert replies[2:] == [2, "xy"]
    assert again == ["xy"]


def test_a_script_reply_and_a_missing_script(rclient: redis.Redis) -> None:
    """NOSCRIPT comes back as a NoScriptError in its place (the writer reloads and sends that call again)."""
    sha = rclient.script_load("return {ARGV[1], 'ok'}")
    held = redis_urls.HeldConnection(rclient)
    try:
        replies = held.execute([("EVALSHA", sha, 0, "a"), ("EVALSHA", "0" * 40, 0)])
    finally:
        held.close()
    assert replies[0] == ["a", "ok"]
    assert isinstance(replies[1], redis.exceptions.NoScriptError)


def test_the_pipelines_of_a_held_connection(rclient: redis.Redis) -> None:
    """PartitionPipelines off a Cluster: the one pipeline's commands go out on the held connection."""
    held = redis_urls.HeldConnection(rclient)
    try:
        pipes = redis_urls.PartitionPipelines(rclient, held)
        pipe = pipes.of(0)
        pipe.set("held:b", "1")
        pipe.incr("held:b")
        pipe.hget("held:b", "f")  # WRONGTYPE
        replies = pipes.execute(raise_on_error=False)[id(pipe)]
        pipes = redis_urls.PartitionPipelines(rclient, held)
        pipes.of(0).hget("held:b", "f")
        with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
            pipes.execute()
        assert redis_urls.PartitionPipelines(rclient, held).execute() == {}  # nothing queued, nothing sent
    finally:
        held.close()
    assert replies[:2] == [True, 2] or replies[:2] == ["OK", 2]
    assert isinstance(replies[2], redis.ResponseError)


def test_it_connects_late_and_reconnects_after_a_restart(tmp_path: Path) -> None:
    """Made before its server is up (the writer process starts with the worker). A batch on a connection the
    server dropped fails as a pipeline's does (a RedisError: the worker drops its jobs and they resume); the
    next batch connects again."""
    port = free_port()
    client = redis_urls.client(f"redis://127.0.0.1:{port}/0", decode_responses=True)
    held = redis_urls.HeldConnection(client)
    server = RedisServer(tmp_path / "redis", port=port).start()
    try:
        assert held.execute([("SET", "held:c", "1")]) in (["OK"], [True])
        server.stop()
        server = RedisServer(tmp_path / "redis", port=port).start()
        with pytest.raises(redis.ConnectionError):
            held.execute([("INCR", "held:c")])
        assert held.execute([("INCR", "held:c")]) == [2]  # reconnected; the AOF kept the SET, the failed INCR never ran
    finally:
        held.close()
        client.close()
        server.stop()


def test_a_cluster_client_is_refused() -> None:
    cluster = redis.cluster.RedisCluster.__new__(redis.cluster.RedisCluster)  # no node needed to be refused
    with pytest.raises(TypeError, match="Cluster"):
        redis_urls.HeldConnection(cluster)


def test_after_a_sentinel_failover_it_reaches_the_new_master(tmp_path: Path) -> None:
    """A reconnect goes through the Sentinel connection's own connect (it asks the sentinels for the master), not
    back to the dead master's address."""
    with LocalSentinel(tmp_path / "sentinel") as group:
        client = redis_urls.client(group.url, decode_responses=True)
        held = redis_urls.HeldConnection(client)
        try:
            assert held.execute([("SET", "held:d", "1")]) in (["OK"], [True])
            assert client.wait(1, 10_000) >= 1  # on the replica before the master dies
            group.kill_master()
            new_master = group.wait_for_failover()
            assert held.execute([("INCR", "held:d")]) == [2]
            info = held.execute([("INFO", "server")])[0]  # raw: no reply callbacks on a held connection
            assert f"tcp_port:{new_master}\r\n" in info
        finally:
            held.close()
            client.close()
