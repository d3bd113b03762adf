"""The one pub/sub connection: followers share a channel's subscription; idle channels are unsubscribed; an
announced event reaches followers without a read of the stream, and a gap is filled by one."""

import asyncio
import json
import time

from redis import Redis as SyncRedis
from redis.asyncio import Redis

from gateway.streaming import Event, EventHub, Wake, _Feed
from shared import keys, lua
from shared.schemas import EventType


def test_one_pattern_subscription_shared_feeds_and_idle_feeds_dropped(redis_url: str) -> None:
    """A hub holds ONE pattern subscription (every job's channel), whatever it follows; a job's followers share
    its feed and are woken together; a feed nobody follows is dropped after linger_s."""

    async def scenario() -> tuple[int, int, int, bool, bool]:
        redis = Redis.from_url(redis_url, decode_responses=True)
        hub = EventHub(redis, redis_url, keepalive_s=1.0, linger_s=0.1)
        await hub.start()
        try:
            channel = keys.job_channel("j1")
            first, second = Wake(), Wake()
            async with hub.watch("j1", first) as feed, hub.watch("j1", second) as same_feed:
                assert feed is same_feed
                patterns = int(await redis.execute_command("PUBSUB", "NUMPAT"))
                channels = dict(await redis.pubsub_numsub(channel))[channel]
                await redis.publish(channel, "1")
                await asyncio.wait_for(asyncio.gather(first.wait(), second.wait()), 5)
                followers = hub.num_followers
                woken = first.is_set() and second.is_set()
            for _ in range(100):  # the sweep runs every keepalive_s / 4; poll its effect with a deadline
                if hub.num_feeds == 0:
                    break
                await asyncio.sleep(0.05)
            return patterns, channels, followers, woken, hub.num_feeds == 0
        finally:
            await hub.stop()
            await redis.aclose()

    assert asyncio.run(scenario()) == (1, 0, 2, True, True)


class _FinishesWhileAsked(EventHub):
    """A hub whose job runs to its end in the window between a follower's read of the events and its read of
    the status: the worker's whole run (start, tokens, done) lands right before the status is read."""

    async def _is_finished(self, job_id: str) -> bool:
        events = keys.job_events(job_id)
        for kind, data in (("status", '{"status": "running"}'), ("token", '{"token_ids": [7]}'), ("done", "{}")):
            await self.redis.xadd(events, {"type": kind, "data": data})
        await self.redis.hset(keys.job_hash(job_id), "status", "succeeded")
        return await super()._is_finished(job_id)


def test_a_job_that_ends_between_the_reads_of_its_events_and_of_its_status_is_streamed_whole(redis_url: str) -> None:
    async def scenario() -> list[str]:
        redis = Redis.from_url(redis_url, decode_responses=True)
        await redis.hset(keys.job_hash("j2"), mapping={"id": "j2", "status": "queued"})  # no event yet
        hub = _FinishesWhileAsked(redis, redis_url, keepalive_s=30.0, linger_s=0.1)
        await hub.start()
        try:
            return [event.type.value async for event in hub.follow("j2") if event is not None]
        finally:
            await hub.stop()
            await redis.aclose()

    assert asyncio.run(asyncio.wait_for(scenario(), 20)) == ["status", "token", "done"]


# PRELUDE's `event` alone: append one event to a job's stream and announce it, as every job script does
_EVENT = lua.PRELUDE + "return event(ctx, KEYS[1], ARGV[2], ARGV[3], ARGV[4])\n"


def _token(token_id: int) -> str:
    return json.dumps({"token_ids": [token_id]})


def _append(redis: SyncRedis, job_id: str, ev_type: str, data: str) -> str:
    ctx = lua.context(maxlen=1000, ttl_s=60)
    return str(redis.eval(_EVENT, 1, keys.job_events(job_id), ctx, job_id, ev_type, data))


def test_an_event_is_announced_with_itself_and_the_id_before_it(redis_url: str) -> None:
    redis = SyncRedis.from_url(redis_url, decode_responses=True)
    pubsub = redis.pubsub(ignore_subscribe_messages=True)
    pubsub.subscribe(keys.job_channel("j3"))
    ids = [_append(redis, "j3", "token", _token(i)) for i in range(3)]
    big = "x" * (lua.WAKE_MAX_BYTES + 1)
    ids.append(_append(redis, "j3", "done", '"' + big + '"'))
    payloads = []
    deadline_s = time.monotonic() + 10.0
    while len(payloads) < 4 and time.monotonic() < deadline_s:  # None: nothing yet, or a subscribe confirmation
        if (message := pubsub.get_message(timeout=1.0)) is not None:
            payloads.append(message["data"])
    wakes = [lua.parse_event_wake(p) for p in payloads]
    assert wakes[:3] == [
        lua.EventWake(prev_id=prev, id=ids[i], type="token", data=_token(i))
        for i, prev in enumerate(["", *ids[:2]])
    ]
    assert payloads[3] == "1" and wakes[3] is None  # too large to carry: a bare wake-up, the follower reads it
    pubsub.close()
    redis.close()


def _xrange_calls(redis: SyncRedis) -> int:
    return int(redis.info("commandstats").get("cmdstat_xrange", {}).get("calls", 0))


def test_followers_take_announced_events_without_reading_and_read_after_a_gap(redis_url: str) -> None:
    """Two followers of one job: the events announced in order reach both with no XRANGE beyond each follower's
    first read; an announcement whose previous id is not the feed's last (a gap: here an event appended without
    one) makes one read that fills the gap, and the streams stay whole and in order."""
    sync = SyncRedis.from_url(redis_url, decode_responses=True)
    sync.hset(keys.job_hash("j4"), mapping={"id": "j4", "status": "running"})
    first_id = _append(sync, "j4", "status", '{"status": "running"}')

    async def follower(hub: EventHub, started: asyncio.Event) -> list[str]:
        seen = []
        async for event in hub.follow("j4"):
            if event is not None:
                seen.append(event.id)
                started.set()
        return seen

    async def scenario() -> tuple[list[list[str]], list[str], int, int]:
        redis = Redis.from_url(redis_url, decode_responses=True)
        hub = EventHub(redis, redis_url, keepalive_s=30.0, linger_s=0.1)
        await hub.start()
        try:
            started = [asyncio.Event(), asyncio.Event()]
            tasks = [asyncio.create_task(follower(hub, s)) for s in started]
            await asyncio.wait_for(asyncio.gather(*(s.wait() for s in started)), 10)
            ids = [first_id]
            reads_before = _xrange_calls(sync)
            for i in range(20):
                ids.append(await asyncio.to_thread(_append, sync, "j4", "token", _token(i)))
                await asyncio.sleep(0.005)
            await asyncio.sleep(0.2)
            reads_in_order = _xrange_calls(sync) - reads_before
            ids.append(str(await redis.xadd(keys.job_events("j4"), {"type": "token", "data": _token(99)})))
            ids.append(await asyncio.to_thread(_append, sync, "j4", "token", _token(100)))
            ids.append(await asyncio.to_thread(_append, sync, "j4", "done", "{}"))
            seen = await asyncio.wait_for(asyncio.gather(*tasks), 10)
            return seen, ids, reads_in_order, _xrange_calls(sync) - reads_before
        finally:
            await hub.stop()
            await redis.aclose()

    seen, ids, reads_in_order, reads_in_all = asyncio.run(scenario())
    assert seen == [ids, ids]
    assert reads_in_order == 0
    assert 1 <= reads_in_all <= 2  # the gap's one read (a second follower may start its own after it)
    sync.close()


def test_a_job_expected_before_its_submit_is_streamed_without_a_read(redis_url: str) -> None:
    """EventHub.expect (a submit that streams its job's events): the feed exists before the job does, so every
    event reaches the follower from its announcement; no XRANGE, no status read."""
    sync = SyncRedis.from_url(redis_url, decode_responses=True)

    async def scenario() -> tuple[list[str], list[str], int]:
        redis = Redis.from_url(redis_url, decode_responses=True)
        hub = EventHub(redis, redis_url, keepalive_s=30.0, linger_s=0.1)
        await hub.start()
        try:
            await asyncio.wait_for(hub.is_hearing.wait(), 10)
            hub.expect("j5")
            reads_before = _xrange_calls(sync) + _hget_calls(sync)
            ids = [await asyncio.to_thread(_append, sync, "j5", "status", '{"status": "running"}')]
            for i in range(3):
                ids.append(await asyncio.to_thread(_append, sync, "j5", "token", _token(i)))
            ids.append(await asyncio.to_thread(_append, sync, "j5", "done", "{}"))
            seen = [e.id async for e in hub.follow("j5") if e is not None]
            return seen, ids, _xrange_calls(sync) + _hget_calls(sync) - reads_before
        finally:
            await hub.stop()
            await redis.aclose()

    seen, ids, reads = asyncio.run(asyncio.wait_for(scenario(), 20))
    assert seen == ids and reads == 0
    sync.close()


def _hget_calls(redis: SyncRedis) -> int:
    return int(redis.info("commandstats").get("cmdstat_hget", {}).get("calls", 0))


def test_a_new_feed_starts_at_its_earliest_follower_and_never_past_one() -> None:
    """A feed that holds nothing and reads nothing starts its run after the earliest position among its
    followers (gateway/streaming.py `_Feed.start_at_followers`): never past one that joined already, never
    moved back, and not for a feed that holds events, reads, or was made before its job (`expect`)."""

    def wake_at(entry_id: str) -> Wake:
        wake = Wake()
        wake.after_key = lua.entry_key(entry_id)
        return wake

    feed = _Feed(waiters={wake_at("7-0"), wake_at("5-2"), wake_at("9-1")})
    feed.start_at_followers()
    assert feed.trimmed_id == "5-2"
    feed.waiters.add(wake_at("3-0"))  # joins later, from an earlier position: it reads up to 5-2 from Redis
    feed.start_at_followers()
    assert feed.trimmed_id == "5-2"
    feed.waiters = {wake_at("8-0")}  # the others left: nothing held, so the run may start later
    feed.start_at_followers()
    assert feed.trimmed_id == "8-0"

    holding = _Feed(waiters={wake_at("5-0")}, events=[Event("4-0", EventType.TOKEN, "{}", (4, 0))])
    expected = _Feed(waiters={wake_at("5-0")}, is_from_start=True)
    past_every_entry = _Feed(waiters={wake_at(f"{2**64 - 1}-{2**64 - 1}")})
    for feed in (holding, expected, past_every_entry):
        feed.start_at_followers()
        assert feed.trimmed_id == "0-0"

    async def while_reading() -> str:
        feed = _Feed(waiters={wake_at("5-0")})
        async with feed.read_lock:  # a read in flight started at the run's start: the start stays
            feed.start_at_followers()
        return feed.trimmed_id

    assert asyncio.run(while_reading()) == "0-0"


def test_a_feed_nobody_follows_goes_at_the_first_tick_after_its_linger(redis_url: str) -> None:
    """Idle feeds are dropped by the keepalive tick's pass over the feeds (every keepalive_s / 4), not by a
    sweep every linger_s: a feed lives at most linger_s and a tick after its last follower left."""

    async def scenario() -> tuple[bool, bool]:
        redis = Redis.from_url(redis_url, decode_responses=True)
        hub = EventHub(redis, redis_url, keepalive_s=0.4, linger_s=30.0)
        await hub.start()
        try:
            async with hub.watch("j1", Wake()) as feed:
                pass
            await asyncio.sleep(0.3)  # a few ticks: it lingers
            lingers = hub.num_feeds == 1
            feed.idle_since = time.monotonic() - 31.0  # as if its last follower left linger_s ago
            for _ in range(50):  # the next tick drops it (a sweep every linger_s would wait ~30 s)
                if hub.num_feeds == 0:
                    break
                await asyncio.sleep(0.1)
            return lingers, hub.num_feeds == 0
        finally:
            await hub.stop()
            await redis.aclose()

    assert asyncio.run(scenario()) == (True, True)
