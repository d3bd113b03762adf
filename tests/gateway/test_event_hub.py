"""The one pub/sub connection: followers share a channel's subscription; idle channels are unsubscribed."""

import asyncio

from redis.asyncio import Redis

from gateway.streaming import EventHub
from shared import keys


def test_shared_subscription_and_idle_unsubscribe(redis_url: str) -> None:
    async def scenario() -> tuple[int, int, bool, int]:
        redis = Redis.from_url(redis_url, decode_responses=True)
        hub = EventHub(redis, keepalive_s=1.0, linger_s=0.1)
        await hub.start()
        try:
            channel = keys.job_channel("j1")
            async with hub.watch("j1") as (first, feed), hub.watch("j1") as (second, same_feed):
                assert feed is same_feed
                subscribers = dict(await redis.pubsub_numsub(channel))[channel]
                await redis.publish(channel, "1")
                await asyncio.wait_for(asyncio.gather(first.wait(), second.wait()), 5)
                followers = hub.num_followers
                woken = first.is_set() and second.is_set()
            for _ in range(100):  # the sweep runs every linger_s; poll its visible effect with a deadline
                if not dict(await redis.pubsub_numsub(channel))[channel]:
                    break
                await asyncio.sleep(0.05)
            return subscribers, followers, woken, dict(await redis.pubsub_numsub(channel))[channel]
        finally:
            await hub.stop()
            await redis.aclose()

    subscribers, followers, woken, after = asyncio.run(scenario())
    assert (subscribers, followers, woken, after) == (1, 2, True, 0)


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
        hub = _FinishesWhileAsked(redis, keepalive_s=30.0, linger_s=0.1)
        await hub.start()
        try:
            return [event.type.value async for event in hub.follow("j2") if event is not None]
        finally:
            await hub.stop()
            await redis.aclose()

    assert asyncio.run(asyncio.wait_for(scenario(), 20)) == ["status", "token", "done"]
