"""The gateway's pub/sub connection (gateway/pubsub.py) against real redis-servers: messages in order, a restart
(lost, connected again, every channel and pattern subscribed again), a password, a unix socket, a connection that stops
answering, and a Sentinel failover (the master the sentinels name at each connect)."""

import asyncio
import ssl
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path

from redis.asyncio import Redis

from gateway.pubsub import Subscriber
from gateway.redis_address import tls_context
from gateway.redis_wire import pack
from shared import redis_url as redis_urls
from shared.redis_server import RedisServer
from shared.redis_topologies import LocalSentinel

DEADLINE_S = 20.0


class _Log:
    """What a Subscriber reported, in order."""

    def __init__(self) -> None:
        self.messages: list[tuple[str, str]] = []
        self.subscribed: list[str] = []
        self.num_lost = 0

    def subscriber(self, url: str, **options: float) -> Subscriber:
        return Subscriber(
            url,
            lambda channel, data: self.messages.append((channel, data)),
            self.subscribed.append,
            self._lost,
            **options,
        )

    def _lost(self) -> None:
        self.num_lost += 1


async def _until(what: str, is_done: Callable[[], bool | Awaitable[bool]]) -> None:
    deadline_s = time.monotonic() + DEADLINE_S
    while True:
        done = is_done()
        if done if isinstance(done, bool) else await done:
            return
        if time.monotonic() > deadline_s:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


async def _published(redis: Redis, channel: str, data: str, log: _Log) -> None:
    """Publish until the subscriber has it (a message sent before its subscription lands is not delivered)."""
    deadline_s = time.monotonic() + DEADLINE_S
    while (channel, data) not in log.messages:
        if time.monotonic() > deadline_s:
            raise AssertionError(f"{data!r} on {channel} never arrived")
        await redis.publish(channel, data)
        await asyncio.sleep(0.05)


def test_commands_are_resp() -> None:
    assert pack([("SUBSCRIBE", "a", "ß")]) == b"*3\r\n$9\r\nSUBSCRIBE\r\n$1\r\na\r\n$2\r\n\xc3\x9f\r\n"


def test_messages_arrive_in_order_and_unsubscribed_channels_go_quiet(redis_url: str) -> None:
    async def scenario() -> tuple[list[tuple[str, str]], list[str]]:
        redis = Redis.from_url(redis_url, decode_responses=True)
        log = _Log()
        subscriber = log.subscriber(redis_url)
        subscriber.subscribe("a", "b")
        subscriber.start()
        try:
            await _until("both confirmations", lambda: sorted(log.subscribed) == ["a", "b"])
            for i in range(200):
                await redis.publish("a" if i % 2 else "b", f"m{i}\nwith a newline")
            await _until("200 messages", lambda: len(log.messages) == 200)
            subscriber.unsubscribe("a")
            await _until("a unsubscribed", lambda: _numsub(redis, "a", 0))
            await redis.publish("a", "not wanted")
            await redis.publish("b", "last")
            await _until("the last message", lambda: log.messages[-1] == ("b", "last"))
            return log.messages, log.subscribed
        finally:
            await subscriber.stop()
            await redis.aclose()

    messages, subscribed = asyncio.run(scenario())
    assert messages[:200] == [("a" if i % 2 else "b", f"m{i}\nwith a newline") for i in range(200)]
    assert messages[200:] == [("b", "last")]  # nothing of `a` after its UNSUBSCRIBE
    assert sorted(subscribed) == ["a", "b"]


async def _numsub(redis: Redis, channel: str, expected: int) -> bool:
    return dict(await redis.pubsub_numsub(channel))[channel] == expected


def test_a_restarted_redis_is_reconnected_and_every_channel_subscribed_again(tmp_path: Path) -> None:
    server = RedisServer(tmp_path / "redis").start()
    restarted = RedisServer(tmp_path / "redis", port=server.port)

    async def scenario() -> tuple[int, list[str], int]:
        log = _Log()
        subscriber = log.subscriber(server.url, reconnect_s=0.05)
        subscriber.subscribe("x", "y")
        subscriber.psubscribe("z:*")
        subscriber.start()
        try:
            await _until("the first confirmations", lambda: len(log.subscribed) == 3)
            await asyncio.to_thread(server.stop)
            await _until("the loss reported", lambda: log.num_lost == 1)
            await asyncio.to_thread(restarted.start)
            await _until("subscribed again", lambda: len(log.subscribed) == 6)
            redis = Redis.from_url(server.url, decode_responses=True)
            try:
                await _published(redis, "y", "after", log)
                await _published(redis, "z:1", "by pattern", log)
            finally:
                await redis.aclose()
            return log.num_lost, log.subscribed, subscriber.num_connects
        finally:
            await subscriber.stop()

    try:
        num_lost, subscribed, num_connects = asyncio.run(scenario())
    finally:
        restarted.stop()
    assert num_lost == 1 and num_connects == 2
    assert sorted(subscribed[:3]) == sorted(subscribed[3:]) == ["x", "y", "z:*"]


def test_a_password_is_sent_and_a_wrong_one_is_refused_without_a_crash(tmp_path: Path) -> None:
    with RedisServer(tmp_path / "redis") as server:
        admin = redis_urls.client(server.url)
        admin.config_set("requirepass", "s3cret")
        admin.close()
        good = f"redis://:s3cret@127.0.0.1:{server.port}/0"
        bad = f"redis://:wrong@127.0.0.1:{server.port}/0"

        async def scenario() -> tuple[list[tuple[str, str]], list[str], int, int]:
            log, refused = _Log(), _Log()
            subscriber = log.subscriber(good)
            wrong = refused.subscriber(bad, reconnect_s=0.05)
            for each in (subscriber, wrong):
                each.subscribe("c")
                each.start()
            await asyncio.sleep(0.6)  # refused connects at ~0, 0.05, 0.15, 0.35 s: pauses double from 0.05 s
            num_connects = wrong.num_connects
            redis = Redis.from_url(good, decode_responses=True)
            try:
                await _until("the confirmation", lambda: log.subscribed == ["c"])
                await _published(redis, "c", "hello", log)
                return log.messages, refused.subscribed, len(refused.messages), num_connects
            finally:
                for each in (subscriber, wrong):
                    await each.stop()
                await redis.aclose()

        messages, refused_subscribed, refused_messages, num_connects = asyncio.run(scenario())
    assert messages[-1] == ("c", "hello")
    assert refused_subscribed == [] and refused_messages == 0  # NOAUTH/WRONGPASS: never subscribed
    assert 2 <= num_connects <= 6  # retried, backing off (a fixed 0.05 s pause would have made a dozen)


def test_a_unix_socket_url(tmp_path: Path) -> None:
    with RedisServer(tmp_path / "redis", unix_socket=True) as server:

        async def scenario() -> list[tuple[str, str]]:
            log = _Log()
            subscriber = log.subscriber(server.url)
            subscriber.subscribe("u")
            subscriber.start()
            redis = Redis.from_url(server.url, decode_responses=True)
            try:
                await _published(redis, "u", "over the socket", log)
                return log.messages
            finally:
                await subscriber.stop()
                await redis.aclose()

        assert asyncio.run(scenario())[-1] == ("u", "over the socket")


@asynccontextmanager
async def _subscribed_to_p(redis_url: str, ping_interval_s: float) -> AsyncIterator[tuple[Redis, _Log, Subscriber]]:
    """A client, and a subscriber to channel "p" whose subscription was confirmed; both closed after."""
    redis = Redis.from_url(redis_url, decode_responses=True)
    log = _Log()
    subscriber = log.subscriber(redis_url, ping_interval_s=ping_interval_s, reconnect_s=0.05)
    subscriber.subscribe("p")
    subscriber.start()
    try:
        await _until("the confirmation", lambda: log.subscribed == ["p"])
        yield redis, log, subscriber
    finally:
        await subscriber.stop()
        await redis.aclose()


def test_a_connection_that_stops_answering_is_replaced(redis_url: str) -> None:
    """CLIENT PAUSE holds every reply, PINGs included: once a PING goes unanswered for a ping interval the
    subscriber drops the connection and connects again; once the pause ends, messages flow on the new one."""

    async def scenario() -> tuple[int, int, list[tuple[str, str]]]:
        async with _subscribed_to_p(redis_url, ping_interval_s=0.1) as (redis, log, subscriber):
            await redis.execute_command("CLIENT", "PAUSE", "1500", "ALL")
            try:
                await _until("the silent connection dropped", lambda: log.num_lost >= 1)
                await _published(redis, "p", "resumed", log)
            finally:
                await redis.execute_command("CLIENT", "UNPAUSE")
            return log.num_lost, subscriber.num_connects, log.messages

    num_lost, num_connects, messages = asyncio.run(scenario())
    assert num_lost >= 1 and num_connects >= 2
    assert messages[-1] == ("p", "resumed")


def test_a_connection_that_answers_is_kept_through_a_stalled_loop(redis_url: str) -> None:
    """The gateway's loop stalls (a burst of requests, a collection) for several ping intervals: silence the
    connection is not to blame for. It is dropped only when a PING of its own goes unanswered, so it stays (a
    reconnect makes every follower re-read its stream); a quiet connection is PINGed and kept."""

    async def scenario() -> tuple[int, int, list[tuple[str, str]]]:
        async with _subscribed_to_p(redis_url, ping_interval_s=0.05) as (redis, log, subscriber):
            for _ in range(3):
                time.sleep(0.25)  # noqa: ASYNC251 - the point: the loop runs nothing for five intervals
                await asyncio.sleep(0.2)  # quiet: PINGs, answered
            await _published(redis, "p", "still here", log)
            return log.num_lost, subscriber.num_connects, log.messages

    assert asyncio.run(scenario()) == (0, 1, [("p", "still here")])


def test_sentinel_the_master_named_at_each_connect(tmp_path: Path) -> None:
    """The subscriber follows a failover: it hears the first master, then (the master SIGKILLed, a replica
    promoted) the new one."""
    with LocalSentinel(tmp_path / "sentinel") as group:

        async def publish_on(port: int, data: str, log: _Log) -> None:
            redis = Redis(host="127.0.0.1", port=port, decode_responses=True)
            try:
                await _published(redis, "s", data, log)
            finally:
                await redis.aclose()

        async def scenario() -> tuple[list[tuple[str, str]], int, int]:
            log = _Log()
            subscriber = log.subscriber(group.url, reconnect_s=0.1)
            subscriber.subscribe("s")
            subscriber.start()
            try:
                old_port = group.master_port()
                await publish_on(old_port, "before", log)
                group.kill_master()
                new_port = await asyncio.to_thread(group.wait_for_failover)
                await publish_on(new_port, "after", log)
                return log.messages, old_port, new_port
            finally:
                await subscriber.stop()

        messages, old_port, new_port = asyncio.run(scenario())
    assert new_port != old_port
    assert ("s", "before") in messages and messages[-1] == ("s", "after")


def test_tls_options_as_redis_py_reads_them() -> None:
    """rediss:// (no TLS-enabled redis-server here to connect to): the context checks the peer as redis-py's
    SSLConnection would, unless the URL says otherwise."""
    default = tls_context({})
    assert default.verify_mode == ssl.CERT_REQUIRED and default.check_hostname
    no_check = tls_context({"ssl_cert_reqs": "none"})
    assert no_check.verify_mode == ssl.CERT_NONE and not no_check.check_hostname
    optional = tls_context({"ssl_cert_reqs": "optional", "ssl_check_hostname": False})
    assert optional.verify_mode == ssl.CERT_OPTIONAL and not optional.check_hostname
