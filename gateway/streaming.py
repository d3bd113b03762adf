"""The token path on the gateway side: ONE pub/sub connection per process, fanned out to every follower.

Per job followed in this process there is one feed: a pub/sub subscription (shared by the job's followers)
and the job's events held so far (one list, shared: a gapless run of the job's event stream). A follower (an
SSE client, or a `Prefer: wait` submit) subscribes first, reads the job's event stream, yields what it has not
sent, and sleeps until a wake-up (or a keepalive tick, which also re-reads: a lost wake-up or a pub/sub
reconnect costs latency, never an event). A wake-up carries its event and the id of the one before it
(shared.lua.EventWake): when that is the feed's last event, the event is appended and no follower reads Redis.
Any other wake-up (a bare one for a large event, one after a gap) marks the feed stale, and ONE of the followers
it woke reads the stream: a read that began after a follower's wake-up saw every event published before it.
The event stream is the truth: nothing is lost, repeated or reordered, whatever the timing of connects and
reconnects. A follower that finds nothing new and the job ended reads the events once more before it ends the
stream: the job may have run to its end between the two reads (all its events written after the first, its
status read after them). Reads of one loop turn go to Redis together, one pipelined write
(gateway/redis_batch.py).
"""

import asyncio
import bisect
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import cast

from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from gateway.redis_batch import CommandBatcher
from shared import keys
from shared.job_state import JobStatus
from shared.lua import EventWake, parse_event_wake
from shared.schemas import EventType

log = logging.getLogger(__name__)

READ_BATCH = 512  # event-stream entries per XRANGE
SUBSCRIBE_WAIT_S = 2.0  # how long a new follower waits for its SUBSCRIBE to be confirmed
CHANNEL_LINGER_S = 10.0  # a feed without followers is dropped (its channel unsubscribed) after this


def entry_key(entry_id: str) -> tuple[int, int]:
    """A stream entry id `<ms>-<seq>` as a sortable key."""
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


@dataclass
class Event:
    id: str  # entry id in the job's event stream: the SSE `id:`
    type: EventType
    data: str  # json
    key: tuple[int, int] = (0, 0)  # entry_key(id)


@dataclass
class _Feed:
    """One job as followed in this process."""

    waiters: set[asyncio.Event] = field(default_factory=set)  # one per follower, set on each wake-up
    subscribed: asyncio.Event = field(default_factory=asyncio.Event)  # SUBSCRIBE confirmed
    idle_since: float | None = None  # when its last follower left
    events: list[Event] = field(default_factory=list)  # the job's event stream from its start, as read so far
    is_stale: bool = True  # a wake-up came that `events` may not hold (nothing read yet, a bare or gapped wake-up)
    read_lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    @property
    def is_complete(self) -> bool:
        return bool(self.events) and self.events[-1].type.is_final

    def events_after(self, after_key: tuple[int, int]) -> list[Event]:
        """The events read so far that come after the one with key `after_key`."""
        return self.events[bisect.bisect_right(self.events, after_key, key=lambda e: e.key) :]

    def take(self, wake: EventWake | None) -> None:
        """A wake-up: append the event it carries when it follows the last one held (`events` stays a gapless run
        of the stream), else mark the feed stale."""
        if wake is None or not self.events or self.events[-1].id != wake.prev_id or self.is_complete:
            self.is_stale = True
            return
        try:
            event_type = EventType(wake.type)
        except ValueError:  # a type this gateway does not know: the stream read says what to do with it
            self.is_stale = True
            return
        self.events.append(Event(id=wake.id, type=event_type, data=wake.data, key=entry_key(wake.id)))

    async def catch_up(self, reads: CommandBatcher, job_id: str, force: bool = False) -> None:
        """Read the events not held yet, when a wake-up could not hand them over (or `force`). A read that began
        after the caller's wake-up saw every event it announced, so the caller waits for it and reads nothing.
        The reads of the feeds one wake-up round woke go to Redis as one pipelined write (redis_batch.py)."""
        if not (self.is_stale or force) or self.is_complete:  # the common case, a wake-up that carried its event
            return
        async with self.read_lock:
            if not (self.is_stale or force) or self.is_complete:
                return
            self.is_stale = False  # a wake-up from now on may announce an event this read misses
            while True:
                after = self.events[-1].id if self.events else "0-0"
                entries = cast(
                    list[tuple[str, dict[str, str]]],
                    await reads.call("XRANGE", keys.job_events(job_id), f"({after}", "+", "COUNT", READ_BATCH),
                )
                last_key = self.events[-1].key if self.events else (0, 0)
                for entry_id, fields in entries:  # a wake-up may have appended some of them meanwhile
                    key = entry_key(entry_id)
                    if key > last_key:
                        self.events.append(Event(entry_id, EventType(fields["type"]), fields["data"], key))
                if len(entries) < READ_BATCH:
                    return


class EventHub:
    def __init__(self, redis: Redis, keepalive_s: float, linger_s: float = CHANNEL_LINGER_S) -> None:
        self.redis = redis
        self.reads = CommandBatcher(redis)  # the feeds' XRANGEs of one loop turn: one write
        self.keepalive_s = keepalive_s
        self.linger_s = linger_s
        self._pubsub = redis.pubsub()
        self._feeds: dict[str, _Feed] = {}  # pub/sub channel -> feed
        self._task: asyncio.Task[None] | None = None
        self._subscribe_lock = asyncio.Lock()

    @property
    def num_followers(self) -> int:
        return sum(len(feed.waiters) for feed in self._feeds.values())

    async def start(self) -> None:
        try:  # connect now, before any follower: concurrent first SUBSCRIBEs could open two connections
            await self._subscribe(keys.HUB_CHANNEL)
        except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
            log.warning("pub/sub unavailable at start (%s); retrying in the background", exc)
        self._task = asyncio.create_task(self._read_loop(), name="event-hub")

    async def _subscribe(self, *channels: str) -> None:
        async with self._subscribe_lock:  # one (re)connect at a time on the shared connection
            await self._pubsub.subscribe(*channels)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        await self._pubsub.aclose()

    async def _read_loop(self) -> None:
        next_sweep_s = time.monotonic() + self.linger_s
        while True:
            try:
                if not self._pubsub.subscribed:  # first, or after failures at startup
                    await self._subscribe(keys.HUB_CHANNEL)
                message = await self._pubsub.get_message(timeout=1.0)
            except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
                log.warning("pub/sub connection lost (%s); waking every follower to re-read", exc)
                for feed in self._feeds.values():
                    feed.is_stale = True
                    for waiter in feed.waiters:
                        waiter.set()
                await asyncio.sleep(0.5)
                continue
            if message is not None:
                self._dispatch(message)
            if time.monotonic() >= next_sweep_s:  # not per message: a sweep visits every feed
                next_sweep_s = time.monotonic() + self.linger_s
                await self._drop_idle_feeds()

    def _dispatch(self, message: dict[str, object]) -> None:
        feed = self._feeds.get(str(message["channel"]))
        if feed is None:
            return
        if message["type"] == "subscribe":
            feed.subscribed.set()
        elif message["type"] == "message":
            feed.take(parse_event_wake(str(message["data"])))
            for waiter in feed.waiters:
                waiter.set()

    async def _drop_idle_feeds(self) -> None:
        """Drop feeds nobody followed for linger_s and unsubscribe their channels (lingering avoids subscribe
        churn and the race of a SUBSCRIBE confirmation arriving for an older subscription of the channel)."""
        now = time.monotonic()
        idle = [
            name
            for name, feed in self._feeds.items()
            if not feed.waiters and feed.idle_since is not None and now - feed.idle_since > self.linger_s
        ]
        for name in idle:
            del self._feeds[name]
        if idle:
            await self._pubsub.unsubscribe(*idle)

    @asynccontextmanager
    async def watch(self, job_id: str) -> AsyncIterator[tuple[asyncio.Event, _Feed]]:
        """(this follower's wake-up event, the job's feed); subscribed (confirmed) before it is yielded."""
        name = keys.job_channel(job_id)
        feed = self._feeds.get(name)
        if feed is None:
            feed = self._feeds[name] = _Feed()
            await self._subscribe(name)
        waiter = asyncio.Event()
        feed.waiters.add(waiter)
        feed.idle_since = None
        try:
            try:
                await asyncio.wait_for(feed.subscribed.wait(), SUBSCRIBE_WAIT_S)
            except TimeoutError:
                log.warning("no SUBSCRIBE confirmation for %s; relying on keepalive re-reads", name)
            yield waiter, feed
        finally:
            feed.waiters.discard(waiter)
            if not feed.waiters:
                feed.idle_since = time.monotonic()

    async def follow(self, job_id: str, after_id: str = "0-0") -> AsyncGenerator[Event | None, None]:
        """The job's events after `after_id`, in order, ending with its final event; None is a keepalive tick."""
        after_key = entry_key(after_id)
        check_finished = True  # on the first pass and after each tick: a resume after the final event ends
        async with self.watch(job_id) as (wake, feed):
            while True:
                wake.clear()
                await feed.catch_up(self.reads, job_id, force=check_finished)
                new = feed.events_after(after_key)
                if not new and check_finished and (feed.is_complete or await self._is_finished(job_id)):
                    if not feed.is_complete:  # the job may have ended after the events were read: read them again
                        await feed.catch_up(self.reads, job_id, force=True)
                        new = feed.events_after(after_key)
                    if not new:
                        return
                check_finished = False
                for event in new:
                    after_key = event.key
                    yield event
                    if event.type.is_final:
                        return
                try:
                    async with asyncio.timeout(self.keepalive_s):  # a timer, not wait_for's task per event
                        await wake.wait()
                except TimeoutError:
                    check_finished = True
                    yield None

    async def _is_finished(self, job_id: str) -> bool:
        status: str | None = await self.redis.hget(keys.job_hash(job_id), "status")  # type: ignore[assignment]
        return status is None or JobStatus(status).is_terminal


def sse_frame(event: Event | None) -> bytes:
    if event is None:
        return b": keepalive\n\n"
    return f"id: {event.id}\nevent: {event.type.value}\ndata: {event.data}\n\n".encode()
