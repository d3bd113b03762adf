"""The gateway's command connection (gateway/redis_wire.py) against real redis-servers: replies as redis-py's
client gives them (errors in place), a password and a database, a unix socket, a restarted Redis, a dropped
connection, a cancelled call, a Sentinel failover, and a server that does not speak RESP3."""

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
from redis.asyncio import Redis
from redis.exceptions import AuthenticationError, DataError, NoScriptError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from gateway.redis_wire import WireConnection, WireUnsupported, pack
from shared import redis_url as redis_urls
from shared.redis_server import RedisServer
from shared.redis_topologies import LocalSentinel


def _run(redis_url: str, body: Callable[[Redis, WireConnection], Awaitable[None]]) -> None:
    async def main() -> None:
        client = redis_urls.async_client(redis_url, decode_responses=True)
        wire = WireConnection.for_url(redis_url, client.response_callbacks)
        assert wire is not None
        try:
            await body(client, wire)
        finally:
            wire.close()
            await client.aclose()

    asyncio.run(main())


def test_replies_are_those_of_redis_pys_client_with_errors_in_place(redis_url: str) -> None:
    commands: list[tuple[str | int, ...]] = [
        ("HSET", "h", "a", "1", "b", "2"), ("HGETALL", "h"), ("HGETALL", "missing"), ("HMGET", "h", "a", "z"),
        ("XADD", "s", "1-1", "type", "token", "data", "{}"), ("XRANGE", "s", "-", "+", "COUNT", 5),
        ("SET", "k", "v"), ("GET", "k"), ("GET", "missing"), ("INCRBY", "n", 7),
        ("EVAL", "return {1, 'a', {2, false}}", 0),
    ]  # fmt: skip

    async def body(client: Redis, wire: WireConnection) -> None:
        expected = [await client.execute_command(*command) for command in commands]
        await client.flushall()
        assert await wire.execute(commands) == expected
        wrong_type, no_script, after = await wire.execute(
            [("HSET", "s", "x", "1"), ("EVALSHA", "0" * 40, 0), ("GET", "k")]
        )
        assert isinstance(wrong_type, ResponseError) and "WRONGTYPE" in str(wrong_type)
        assert isinstance(no_script, NoScriptError) and after == "v"
        assert wire.num_connects == 1

    _run(redis_url, body)


def test_arguments_are_encoded_as_redis_py_encodes_them(redis_url: str) -> None:
    assert pack([("SET", "k", 12, 2.5, b"\x00", "é")]) == (
        b"*6\r\n$3\r\nSET\r\n$1\r\nk\r\n$2\r\n12\r\n$3\r\n2.5\r\n$1\r\n\x00\r\n$2\r\n\xc3\xa9\r\n"
    )

    async def body(client: Redis, wire: WireConnection) -> None:
        with pytest.raises(DataError, match="bool"):
            await wire.execute([("SET", "k", True)])
        assert wire.num_connects == 0  # refused before anything was sent
        await wire.execute([("SET", "f", 0.1), ("SET", "i", -3)])
        assert await client.mget("f", "i") == ["0.1", "-3"]

    _run(redis_url, body)


def test_a_password_and_a_database_and_a_wrong_password(tmp_path: Path) -> None:
    with RedisServer(tmp_path / "redis") as server:
        admin = redis_urls.client(server.url)
        admin.config_set("requirepass", "s3cret")
        admin.close()

        async def body(client: Redis, wire: WireConnection) -> None:
            await wire.execute([("SET", "where", "db3")])
            assert await client.get("where") == "db3"
            in_db0 = Redis(port=server.port, password="s3cret", decode_responses=True)
            assert await in_db0.get("where") is None
            await in_db0.aclose()
            wrong = WireConnection.for_url(f"redis://:wrong@127.0.0.1:{server.port}/0", {})
            assert wrong is not None
            with pytest.raises(AuthenticationError, match="WRONGPASS"):
                await wrong.execute([("GET", "where")])
            wrong.close()

        _run(f"redis://:s3cret@127.0.0.1:{server.port}/3", body)


def test_a_unix_socket(tmp_path: Path) -> None:
    with RedisServer(tmp_path / "redis", unix_socket=True) as server:

        async def body(client: Redis, wire: WireConnection) -> None:
            assert await wire.execute([("SET", "u", "1"), ("GET", "u")]) == [True, "1"]

        _run(server.url, body)


def test_a_restarted_redis_is_connected_again(tmp_path: Path) -> None:
    server = RedisServer(tmp_path / "redis").start()
    restarted = RedisServer(tmp_path / "redis", port=server.port)

    async def body(client: Redis, wire: WireConnection) -> None:
        assert await wire.execute([("SET", "k", "1")]) == [True]
        await asyncio.to_thread(server.stop)
        with pytest.raises(RedisConnectionError):  # lost, then refused
            await wire.execute([("GET", "k")])
        await asyncio.to_thread(restarted.start)
        assert await wire.execute([("SET", "k", "2"), ("GET", "k")]) == [True, "2"]
        assert wire.num_connects == 2

    try:
        _run(server.url, body)
    finally:
        restarted.stop()


def test_a_dropped_connection_fails_what_it_was_waiting_for_and_the_next_call_connects(redis_url: str) -> None:
    async def body(client: Redis, wire: WireConnection) -> None:
        await wire.execute([("CLIENT", "SETNAME", "wire")])
        blocked = asyncio.create_task(wire.execute([("BLPOP", "nothing", 5)]))
        await asyncio.sleep(0.2)
        wire_id = next(c["id"] for c in await client.client_list() if c["name"] == "wire")
        assert await client.client_kill_filter(_id=wire_id) == 1
        with pytest.raises(RedisConnectionError, match="lost"):
            await blocked
        assert await wire.execute([("SET", "k", "1"), ("GET", "k")]) == [True, "1"]
        assert wire.num_connects == 2

    _run(redis_url, body)


def test_a_cancelled_call_drops_the_connection_so_no_reply_answers_another(redis_url: str) -> None:
    """A reply still due when its caller gave up (the batcher's timeout) would answer the next command sent on
    the connection: the connection is dropped instead, and the calls waiting behind it fail as timed out."""

    async def body(client: Redis, wire: WireConnection) -> None:
        await client.rpush("later", "x")
        first = asyncio.create_task(wire.execute([("BLPOP", "nothing", 1)]))
        behind = asyncio.create_task(wire.execute([("LPOP", "later")]))
        await asyncio.sleep(0.1)
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        with pytest.raises(RedisTimeoutError):
            await behind
        assert await wire.execute([("SET", "k", "1"), ("GET", "k")]) == [True, "1"]
        assert wire.num_connects == 2

    _run(redis_url, body)


def test_sentinel_the_master_named_at_each_connect(tmp_path: Path) -> None:
    with LocalSentinel(tmp_path / "sentinel") as group:

        async def body(client: Redis, wire: WireConnection) -> None:
            assert await wire.execute([("SET", "k", "before")]) == [True]
            old_port = group.master_port()
            group.kill_master()
            new_port = await asyncio.to_thread(group.wait_for_failover)
            for _ in range(100):  # the first call after the kill fails (lost), the next connect asks the sentinels
                try:
                    assert await wire.execute([("SET", "k", "after")]) == [True]
                    break
                except RedisConnectionError:
                    await asyncio.sleep(0.1)
            on_new = Redis(host="127.0.0.1", port=new_port, decode_responses=True)
            assert await on_new.get("k") == "after" and new_port != old_port
            await on_new.aclose()

        _run(group.url, body)


def test_a_cluster_keeps_redis_pys_client() -> None:
    assert WireConnection.for_url("redis+cluster://127.0.0.1:7000,127.0.0.1:7001", {}) is None


def test_a_server_without_resp3_is_reported_so_the_caller_falls_back() -> None:
    """A Redis before 6.0 answers HELLO with an unknown-command error (a real TCP server speaking it here)."""

    async def main() -> None:
        async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.read(1024)
            writer.write(b"-ERR unknown command 'HELLO'\r\n")
            await writer.drain()
            writer.close()
            await writer.wait_closed()

        server = await asyncio.start_server(answer, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        wire = WireConnection.for_url(f"redis://127.0.0.1:{port}/0", {})
        assert wire is not None
        try:
            with pytest.raises(WireUnsupported, match="RESP3"):
                await wire.execute([("GET", "k")])
            assert not wire.is_usable
        finally:
            wire.close()
            server.close()
            await server.wait_closed()

    asyncio.run(main())
