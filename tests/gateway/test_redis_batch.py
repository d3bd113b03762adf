"""CommandBatcher and ScriptBatcher against a real Redis: the calls of one loop turn go out as one write (an eager
batcher's at once, up to its bound), each gets its own reply or its own error, and a Redis that lost its scripts
gets the script again. Every test runs both ways a batch travels: on redis-py's pooled connections, and on the
gateway's command connection (gateway/redis_wire.py)."""

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import cast

import pytest
from redis.asyncio import Redis
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from gateway.redis_batch import MAX_EAGER_IN_FLIGHT, MAX_IN_FLIGHT, CommandBatcher, ScriptBatcher
from gateway.redis_wire import WireConnection

# KEYS[1]: a counter. ARGV[1]: a step ('boom': the script fails) -> the counter after the step
SCRIPT = """
if ARGV[1] == 'boom' then return redis.error_reply('boom') end
return redis.call('INCRBY', KEYS[1], ARGV[1])
"""


@pytest.fixture(params=["redis-py", "wire"])
def travel(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def _run(redis_url: str, travel: str, body: Callable[[Redis, WireConnection | None], Awaitable[None]]) -> None:
    async def main() -> None:
        client = Redis.from_url(redis_url, decode_responses=True)
        wire = WireConnection.for_url(redis_url, client.response_callbacks) if travel == "wire" else None
        try:
            await body(client, wire)
        finally:
            if wire is not None:
                wire.close()
            await client.aclose()

    asyncio.run(main())


def test_one_turns_calls_are_one_write_with_their_own_replies(redis_url: str, travel: str) -> None:
    async def body(client: Redis, wire: WireConnection | None) -> None:
        batcher = ScriptBatcher(client, SCRIPT, wire=wire)
        replies = await asyncio.gather(*(batcher.run([f"n{i % 2}"], [1]) for i in range(20)))
        assert sorted(replies) == sorted([*range(1, 11), *range(1, 11)])  # type: ignore[type-var]
        assert batcher.num_calls == 20 and batcher.num_sends < 20
        assert await batcher.run(["n0"], [5]) == 15  # a call alone is sent at once
        assert batcher.num_sends < 21

    _run(redis_url, travel, body)


# -> Redis's clock (TIME) as seconds, when the script ran
TIME_SCRIPT = """
local now = redis.call('TIME')
return tostring(now[1]) .. '.' .. string.format('%06d', tonumber(now[2]))
"""


def test_an_eager_batchers_calls_are_written_at_once(redis_url: str, travel: str) -> None:
    """Requests handled one after the other in one loop turn (~50 ms of work each, here a sleep that holds the
    loop): an eager batcher's script runs in Redis while the next request is handled, not once the turn ended; on
    redis-py's pool it batches all the same (a call at once would hold a pooled connection each)."""

    async def body(client: Redis, wire: WireConnection | None) -> None:
        batcher = ScriptBatcher(client, TIME_SCRIPT, wire=wire, eager=True)
        assert await batcher.run([], []) is not None  # connected (and the script loaded)
        sends_before = batcher.num_sends
        handled_s: list[float] = []

        async def request() -> float:
            time.sleep(0.05)  # the request's handling before its submit (holds the loop, as Python does)
            handled_s.append(time.time())
            ran_at = await batcher.run([], [])
            return float(cast(str, ran_at))

        ran_s = await asyncio.gather(*(request() for _ in range(4)))
        if travel == "wire":  # each ran before the next request's handling ended
            assert all(ran < handled_s[i + 1] for i, ran in enumerate(ran_s[:-1])), (ran_s, handled_s)
            assert batcher.num_sends - sends_before == 4
        else:  # one batch, once the turn ended
            assert all(ran > handled_s[-1] for ran in ran_s), (ran_s, handled_s)
            assert batcher.num_sends - sends_before == 1

    _run(redis_url, travel, body)


def test_an_eager_batcher_batches_beyond_its_bound(redis_url: str) -> None:
    """A flood: MAX_EAGER_IN_FLIGHT calls of one turn are written at once, the rest go as one batch."""

    async def body(client: Redis, wire: WireConnection | None) -> None:
        batcher = ScriptBatcher(client, SCRIPT, wire=wire, eager=True)
        assert await batcher.run(["n"], [1]) == 1  # the connection is made by a batch: eager calls need it open
        num_calls = MAX_EAGER_IN_FLIGHT + 4
        replies = await asyncio.gather(*(batcher.run(["n"], [1]) for _ in range(num_calls)))
        assert sorted(replies) == list(range(2, num_calls + 2))  # type: ignore[type-var]
        assert batcher.num_calls == num_calls + 1 and batcher.num_sends == 1 + MAX_EAGER_IN_FLIGHT + 1

    _run(redis_url, "wire", body)


def test_a_cancelled_eager_caller_leaves_the_connection_alone(redis_url: str) -> None:
    """A request cancelled (its client left) after its submit was written: the command runs all the same, and the
    connection that carries every other request's commands stays up."""

    async def body(client: Redis, wire: WireConnection | None) -> None:
        assert wire is not None
        batcher = ScriptBatcher(client, SCRIPT, wire=wire, eager=True)
        assert await batcher.run(["k"], [1]) == 1  # connected
        first = asyncio.ensure_future(batcher.run(["k"], [1]))
        await asyncio.sleep(0)  # written
        first.cancel()
        assert await batcher.run(["k"], [1]) == 3
        assert wire.num_connects == 1

    _run(redis_url, "wire", body)


@pytest.mark.parametrize("eager", [False, True])
def test_a_failing_call_fails_alone(redis_url: str, travel: str, eager: bool) -> None:
    async def body(client: Redis, wire: WireConnection | None) -> None:
        batcher = ScriptBatcher(client, SCRIPT, wire=wire, eager=eager)
        replies = await asyncio.gather(
            batcher.run(["k"], [1]), batcher.run(["k"], ["boom"]), batcher.run(["k"], [2]),
            return_exceptions=True,
        )
        assert replies[0] == 1 and replies[2] == 3
        assert isinstance(replies[1], ResponseError) and "boom" in str(replies[1])

    _run(redis_url, travel, body)


@pytest.mark.parametrize("eager", [False, True])
@pytest.mark.parametrize("num_calls", [1, 5])
def test_a_redis_that_lost_its_scripts_gets_them_again(
    redis_url: str, travel: str, num_calls: int, eager: bool
) -> None:
    async def body(client: Redis, wire: WireConnection | None) -> None:
        batcher = ScriptBatcher(client, SCRIPT, wire=wire, eager=eager)
        assert await batcher.run(["k"], [1]) == 1
        await client.script_flush()  # as after a restart of Redis
        replies = await asyncio.gather(*(batcher.run(["k"], [1]) for _ in range(num_calls)))
        assert sorted(replies) == list(range(2, 2 + num_calls))  # type: ignore[type-var]

    _run(redis_url, travel, body)


def test_commands_of_one_turn_are_one_write(redis_url: str, travel: str) -> None:
    async def body(client: Redis, wire: WireConnection | None) -> None:
        await client.xadd("s", {"n": "1"})
        batcher = CommandBatcher(client, wire=wire)
        replies = await asyncio.gather(
            *(batcher.call("XRANGE", "s", "-", "+", "COUNT", 10) for _ in range(8)),
            batcher.call("HSET", "s", "x", "1"),  # a wrong type: this call alone fails
            return_exceptions=True,
        )
        assert all(r == [(replies[0][0][0], {"n": "1"})] for r in replies[:8])  # type: ignore[index]
        assert isinstance(replies[8], ResponseError) and "WRONGTYPE" in str(replies[8])
        assert batcher.num_calls == 9 and batcher.num_sends < 9
        with pytest.raises(ResponseError, match="WRONGTYPE"):  # alone: sent at once, its error all the same
            await batcher.call("HSET", "s", "x", "1")

    _run(redis_url, travel, body)


def test_a_requests_commands_share_the_turns_write(redis_url: str, travel: str) -> None:
    async def body(client: Redis, wire: WireConnection | None) -> None:
        await client.hset("h", mapping={"owner": "k1", "status": "queued"})
        batcher = CommandBatcher(client, wire=wire)
        mine = batcher.calls(("HGETALL", "h"), ("HMGET", "h", "owner", "status"), ("HGETALL", "missing"))
        others = [batcher.call("HGET", "h", "owner") for _ in range(4)]
        replies, *owners = await asyncio.gather(mine, *others)
        # in order, parsed as the client parses them (HGETALL: a dict)
        assert replies == [{"owner": "k1", "status": "queued"}, ["k1", "queued"], {}]
        assert owners == ["k1"] * 4
        assert batcher.num_calls == 7 and batcher.num_sends == 1
        with pytest.raises(ResponseError, match="WRONGTYPE"):  # one command's error fails the request's calls
            await batcher.calls(("HGETALL", "h"), ("XRANGE", "h", "-", "+"))

    _run(redis_url, travel, body)


def test_calls_of_many_turns_wait_for_a_batch_to_come_back(redis_url: str, travel: str) -> None:
    """Calls issued turn after turn while batches are out: at most MAX_IN_FLIGHT batches (connections) at once,
    the calls of the turns between go together in the next one, and every call gets its own reply."""

    async def body(client: Redis, wire: WireConnection | None) -> None:
        counter = Redis.from_url(redis_url, decode_responses=True)
        connected_before = int((await counter.info("stats"))["total_connections_received"])
        batcher = CommandBatcher(client, wire=wire)

        async def incr_later(turn: int) -> object:
            for _ in range(turn):
                await asyncio.sleep(0)
            return await batcher.call("INCR", "n")

        replies = await asyncio.gather(*(incr_later(turn) for turn in range(200)))
        assert sorted(replies) == list(range(1, 201))  # type: ignore[type-var]
        assert batcher.num_calls == 200 and batcher.num_sends < 100
        connected = int((await counter.info("stats"))["total_connections_received"]) - connected_before
        assert connected <= MAX_IN_FLIGHT + 1  # + the counter's own
        await counter.aclose()

    _run(redis_url, travel, body)


def test_a_batch_redis_does_not_answer_fails_and_frees_its_slot(redis_url: str, travel: str) -> None:
    """CLIENT PAUSE holds every reply: the batches out fail with Redis's TimeoutError after reply_timeout_s (the
    gateway answers 503), their slots free, and once Redis answers again so do the calls."""

    async def body(client: Redis, wire: WireConnection | None) -> None:
        admin = Redis.from_url(redis_url, decode_responses=True)
        batcher = CommandBatcher(client, reply_timeout_s=0.3, wire=wire)
        await batcher.call("SET", "k", "1")  # connected before the pause
        await admin.execute_command("CLIENT", "PAUSE", "1500", "WRITE")
        try:
            stuck = await asyncio.gather(*(batcher.call("SET", "k", str(i)) for i in range(MAX_IN_FLIGHT + 3)),
                                         return_exceptions=True)
        finally:
            await admin.execute_command("CLIENT", "UNPAUSE")
            await admin.aclose()
        assert stuck and all(isinstance(r, RedisTimeoutError) for r in stuck), stuck
        assert await batcher.call("SET", "after", "2") is True and await batcher.call("GET", "after") == "2"

    _run(redis_url, travel, body)
