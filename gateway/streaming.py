"""The token path on the gateway side: ONE pub/sub connection per process (gateway/pubsub.py), subscribed to
every job's channel with one pattern, fanned out to every follower.

Per job followed in this process there is one feed: the job's events held so far (one list, shared by the job's
followers: a gapless run of the job's event stream, up to its newest). What every follower has passed is dropped
from the run's start, a trim's worth at a time (`_Feed.trim`), so a long job's stream holds a window, not its
whole output; a follower that needs a dropped event (a resume from an earlier Last-Event-ID, a stream opened late)
reads that range from Redis first, then joins the feed. A feed made for a stream on a job no feed here held starts
at that stream's position (a resume reads no event before it), and a feed behind its job's newest event reads a
batch at a time, so a stream opened late on a long job holds a window too. A follower (an SSE client, or a
`Prefer: wait` submit) reads the job's event stream once the hub hears every job, yields what it has not sent, and
sleeps until a wake-up (or the hub's keepalive tick after keepalive_s of quiet, which also re-reads: a lost
wake-up costs latency, never an event; a pub/sub reconnect wakes every follower to re-read). A wake-up carries its
event and the id of the one before it (shared.lua.EventWake): when that is the feed's last event, the event is
appended and no follower reads Redis. Any other wake-up (a bare one for a large event, one after a gap) marks the
feed stale, and ONE of the followers it woke reads the stream: a read that began after a follower's wake-up saw
every event published before it. A submit that streams its job's events makes the job's feed before the job exists
(`expect`): it then holds every event from the first, and its follower reads nothing. The event stream is the
truth: nothing is lost, repeated or reordered, whatever the timing of connects and reconnects. A follower that
finds nothing new and the job ended reads the events once more before it ends the stream: the job may have run to
its end between the two reads (all its events written after the first, its status read after them). Reads of one
loop turn go to Redis together, one pipelined write (gateway/redis_batch.py).

Every gateway process hears every job's events (one pattern, no SUBSCRIBE per job, so a new stream waits for
no confirmation): each message costs a process that does not follow the job a parse and a dictionary miss.
"""

import asyncio
import bisect
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass, field
from typing import cast

from redis.asyncio import Redis

from gateway.pubsub import Subscriber, cancel
from gateway.redis_batch import CommandBatcher
from gateway.redis_wire import WireConnection
from shared import keys
from shared.job_state import JobStatus
from shared.lua import EventWake, entry_key, parse_event_wake
from shared.schemas import EventType

log = logging.getLogger(__name__)

READ_BATCH = 512  # event-stream entries per XRANGE: a feed behind its job reads this many at a time
SUBSCRIBE_WAIT_S = 2.0  # how long a follower waits for the hub's PSUBSCRIBE to be confirmed (at start)
CHANNEL_LINGER_S = 10.0  # a feed without followers is dropped after this (a resumed stream finds it held)
# a followed feed drops the events all its followers yielded, this many or more at a time: ~386 bytes an event
# held, so a 32,000-token job's stream held ~12 MB in the gateway before (one event a token at one client)
FEED_TRIM_EVENTS = 256
MAX_START_KEY = (2**64 - 1, 2**64 - 1)  # Redis's largest entry id: an XRANGE cannot start after it
JOB_CHANNELS = keys.CHANNEL_PREFIX + "*"  # every job's channel: ONE pattern subscription per gateway process


@dataclass
class Event:
    id: str  # entry id in the job's event stream: the SSE `id:`
    type: EventType
    data: str  # json
    key: tuple[int, int] = (0, 0)  # entry_key(id)


class Wake(asyncio.Event):
    """A follower's wake-up: set by each announcement of its job, by the hub's keepalive tick (`ticked`) once
    it has waited keepalive_s (one timer for every follower, not one per wait), and by `close` (its client left:
    the follower ends at its next wake-up)."""

    linked: "tuple[Wake, ...]" = ()  # closed with this one: the wake-ups of a client's other followers (`n` choices)

    def __init__(self) -> None:
        super().__init__()
        self.ticked = False
        self.is_closed = False
        self.waiting_since_s = time.monotonic()
        self.after_key: tuple[int, int] = (0, 0)  # its follower's last event yielded (or the one it resumes after)

    def close(self) -> None:
        self.is_closed = True
        self.set()
        for other in self.linked:
            other.close()


@dataclass
class _Feed:
    """One job as followed in this process."""

    waiters: set[Wake] = field(default_factory=set)  # one per follower, set on each wake-up
    idle_since: float | None = None  # when its last follower left
    events: list[Event] = field(default_factory=list)  # a gapless run of the job's event stream, to its newest
    trimmed_id: str = "0-0"  # the last event dropped from the run's start (`trim`); "0-0": none
    is_stale: bool = True  # a wake-up came that `events` may not hold (nothing read yet, a bare or gapped wake-up)
    is_from_start: bool = False  # made before the job existed, while the hub heard every job: no event missed
    read_lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    @property
    def trimmed_key(self) -> tuple[int, int]:
        return entry_key(self.trimmed_id)

    @property
    def is_complete(self) -> bool:
        return bool(self.events) and self.events[-1].type.is_final

    def position_after(self, after_key: tuple[int, int], hint: int = 0) -> int:
        """The index in `events` of the first event after the one with key `after_key`; `hint`: the index just
        after the caller's last event, taken when it still holds (`events` grows at its end; after a trim the
        hint misses and the search finds it). `after_key` is never before `trimmed_key` (`EventHub.follow`)."""
        if 0 < hint <= len(self.events) and self.events[hint - 1].key == after_key:
            return hint
        return bisect.bisect_right(self.events, after_key, key=lambda e: e.key)

    def start_at_followers(self) -> None:
        """A feed that holds nothing and is not reading (a stream opened on a job no feed here held: a resume after
        the linger, a job another gateway process streamed) starts its run after its followers' earliest
        position, not at the job's first event. Never before a follower that joined already (it checked the
        run's start); one that joins later with an earlier position reads what comes before the start from
        Redis, as after a trim (`EventHub.follow`)."""
        if self.events or self.is_from_start or self.read_lock.locked() or not self.waiters:
            return
        start = min(waiter.after_key for waiter in self.waiters)
        if self.trimmed_key < start < MAX_START_KEY:  # a Last-Event-ID past any stream entry reads as before
            self.trimmed_id = f"{start[0]}-{start[1]}"

    def trim(self, min_events: int) -> None:
        """Drop the events every follower has yielded, once at least `min_events` can go at a time; the last event
        stays (whether the job ended). A follower that needs a dropped one reads it from Redis (`EventHub.follow`);
        a feed nobody follows keeps what it holds, for a resume within its linger."""
        if len(self.events) <= min_events or not self.waiters:
            return
        oldest = min(waiter.after_key for waiter in self.waiters)
        num = min(bisect.bisect_right(self.events, oldest, key=lambda e: e.key), len(self.events) - 1)
        if num < min_events:
            return
        self.trimmed_id = self.events[num - 1].id
        del self.events[:num]

    def take(self, wake: EventWake | None) -> None:
        """A wake-up: append the event it carries when it follows the last one held (`events` stays a gapless run
        of the stream), else mark the feed stale."""
        last_id = self.events[-1].id if self.events else ("" if self.is_from_start else None)
        if wake is None or last_id != wake.prev_id or self.is_complete:
            self.is_stale = True
            return
        try:
            event_type = EventType(wake.type)
        except ValueError:  # a type this gateway does not know: the stream read says what to do with it
            self.is_stale = True
            return
        self.events.append(Event(id=wake.id, type=event_type, data=wake.data, key=entry_key(wake.id)))

    async def catch_up(
        self, reads: CommandBatcher, job_id: str, force: bool = False, batch: int = READ_BATCH
    ) -> None:
        """Read the events not held yet, when a wake-up could not hand them over (or `force`): `batch` of them at
        most, so a feed behind by a long job's output (a stream opened late) holds a batch ahead of its
        followers, not that output; it stays stale while there is more to read, and its followers read again
        without waiting. A read that began after the caller's wake-up saw every event it announced, so the caller
        waits for it and reads nothing. The reads of the feeds one wake-up round woke go to Redis as one
        pipelined write (redis_batch.py)."""
        if not (self.is_stale or force or self.read_lock.locked()) or self.is_complete:
            return  # the common case: a wake-up that carried its event, no read in flight
        async with self.read_lock:  # a read in flight may hold what woke this caller: wait for it
            if not (self.is_stale or force) or self.is_complete:
                return
            self.is_stale = False  # a wake-up from now on may announce an event this read misses
            after = self.events[-1].id if self.events else self.trimmed_id
            read = await read_events(reads, job_id, after, count=batch)
            last_key = self.events[-1].key if self.events else self.trimmed_key
            # a wake-up may have appended some of them meanwhile
            self.events += [event for event in read if event.key > last_key]
            if len(read) == batch:  # there may be more: the next pass of a follower reads on
                self.is_stale = True


async def read_events(
    reads: CommandBatcher, job_id: str, after_id: str, last_id: str = "+", count: int = READ_BATCH
) -> list[Event]:
    """The job's events after `after_id`, up to `last_id`, from its event stream in Redis: `count` at most."""
    entries = cast(
        list[tuple[str, dict[str, str]]],
        await reads.call("XRANGE", keys.job_events(job_id), f"({after_id}", last_id, "COUNT", count),
    )
    return [
        Event(entry_id, EventType(fields["type"]), fields["data"], entry_key(entry_id))
        for entry_id, fields in entries
    ]


class EventHub:
    def __init__(
        self,
        redis: Redis,
        redis_url: str,
        keepalive_s: float,
        linger_s: float = CHANNEL_LINGER_S,
        wire: WireConnection | None = None,  # the process's command connection (gateway/redis_wire.py)
        trim_events: int = FEED_TRIM_EVENTS,  # _Feed.trim
        read_batch: int = READ_BATCH,  # event-stream entries per XRANGE (_Feed.catch_up, _read_range)
    ) -> None:
        self.redis = redis
        self.reads = CommandBatcher(redis, wire=wire)  # the feeds' XRANGEs of one loop turn: one write
        self.keepalive_s = keepalive_s
        self.linger_s = linger_s
        self.trim_events = trim_events
        self.read_batch = read_batch
        self.pubsub = Subscriber(redis_url, self._on_message, self._on_subscribed, self._on_lost)
        self.is_hearing = asyncio.Event()  # the pattern subscription is confirmed and its connection up
        self._feeds: dict[str, _Feed] = {}  # pub/sub channel -> feed
        self._task: asyncio.Task[None] | None = None

    @property
    def num_followers(self) -> int:
        return sum(len(feed.waiters) for feed in self._feeds.values())

    @property
    def num_feeds(self) -> int:
        return len(self._feeds)

    async def start(self) -> None:
        self.pubsub.psubscribe(JOB_CHANNELS)
        self.pubsub.start()
        self._task = asyncio.create_task(self._tick_loop(), name="event-hub")

    async def stop(self) -> None:
        await cancel(self._task)
        await self.pubsub.stop()

    async def _tick_loop(self) -> None:
        """Every quarter of keepalive_s: keepalive ticks for followers that waited keepalive_s, and the drop of
        feeds nobody followed for linger_s (a feed kept that long serves a client resuming its stream without a
        read), in one pass over the feeds."""
        while True:
            await asyncio.sleep(self.keepalive_s / 4)
            now = time.monotonic()
            idle = []
            for name, feed in self._feeds.items():
                for waiter in feed.waiters:
                    if not waiter.is_set() and now - waiter.waiting_since_s >= self.keepalive_s:
                        waiter.ticked = True
                        waiter.set()
                if not feed.waiters and feed.idle_since is not None and now - feed.idle_since > self.linger_s:
                    idle.append(name)
            for name in idle:
                del self._feeds[name]

    def _on_message(self, channel: str, data: str) -> None:
        feed = self._feeds.get(channel)
        if feed is not None:  # every job's events reach every gateway: most are another process's
            feed.take(parse_event_wake(data))
            for waiter in feed.waiters:
                waiter.set()

    def _on_subscribed(self, pattern: str) -> None:
        """The pattern confirmed: at start, followers may read; after a reconnect, every feed re-reads what was
        published while the connection was down."""
        if pattern != JOB_CHANNELS:
            return
        for feed in self._feeds.values():
            self._wake_to_reread(feed)
        self.is_hearing.set()

    def _on_lost(self) -> None:
        self.is_hearing.clear()
        for feed in self._feeds.values():
            self._wake_to_reread(feed)

    @staticmethod
    def _wake_to_reread(feed: _Feed) -> None:
        feed.is_stale = True
        for waiter in feed.waiters:
            waiter.set()

    def expect(self, job_id: str) -> None:
        """A job about to be created here (its submit not sent yet): its feed from now on holds every event the
        job will have, so its first follower reads nothing from Redis. Only while the hub hears every job; a
        feed nobody follows goes after linger_s, as any other."""
        name = keys.job_channel(job_id)
        if self.is_hearing.is_set() and name not in self._feeds:
            self._feeds[name] = _Feed(is_stale=False, is_from_start=True, idle_since=time.monotonic())

    @asynccontextmanager
    async def watch(self, job_id: str, waiter: Wake) -> AsyncIterator[_Feed]:
        """The job's feed, with `waiter` among its followers' wake-ups, once the hub hears every job."""
        name = keys.job_channel(job_id)
        feed = self._feeds.get(name)
        if feed is None:
            feed = self._feeds[name] = _Feed()
        feed.waiters.add(waiter)
        feed.idle_since = None
        try:
            if not self.is_hearing.is_set():
                try:
                    await asyncio.wait_for(self.is_hearing.wait(), SUBSCRIBE_WAIT_S)
                except TimeoutError:
                    log.warning("pub/sub not subscribed yet; %s relies on keepalive re-reads", name)
            yield feed
        finally:
            feed.waiters.discard(waiter)
            if not feed.waiters:
                feed.idle_since = time.monotonic()

    async def follow(
        self, job_id: str, after_id: str = "0-0", wake: Wake | None = None
    ) -> AsyncGenerator[Event | None, None]:
        """The job's events after `after_id`, in order, ending with its final event; None is a keepalive tick.
        `wake`: the follower's wake-up, when its caller closes it (a client that left); the events end there."""
        async with aclosing(self.follow_runs(job_id, after_id, wake)) as runs:
            async for run in runs:
                for event in run:
                    yield event

    async def follow_runs(
        self, job_id: str, after_id: str = "0-0", wake: Wake | None = None
    ) -> AsyncGenerator[list[Event | None], None]:
        """follow()'s events, each run of those at hand together as one list (the last token and the final event
        of a step's wake-up: a stream writes them, and its end, in one socket write); [None] is a keepalive."""
        after_key = entry_key(after_id)
        position = 0  # in feed.events, of the first event not yielded yet
        wake = wake if wake is not None else Wake()
        wake.after_key = after_key  # before the feed counts this follower: no trim drops what it still needs
        async with self.watch(job_id, wake) as feed:
            feed.start_at_followers()
            if after_key < feed.trimmed_key:  # a resume or a late join: what the feed dropped comes from Redis
                async with aclosing(self._read_range(job_id, after_id, feed.trimmed_id)) as dropped:
                    async for event in dropped:
                        after_key = wake.after_key = event.key
                        yield [event]
            # on the first pass and after each tick: read, and end a stream resumed after the job's final event;
            # not for a feed that has held the job's events from its start (`expect`: a job just submitted)
            check_finished = not (feed.is_from_start and not feed.is_stale)
            while not wake.is_closed:
                wake.clear()
                await feed.catch_up(self.reads, job_id, force=check_finished, batch=self.read_batch)
                position = feed.position_after(after_key, position)
                new = feed.events[position:]
                # nothing after the cursor in a feed that holds the final event (a resume past it: no Redis read),
                # or in a job that ended by its status, read on a first pass and after each tick
                if not new and (feed.is_complete or (check_finished and await self._is_finished(job_id))):
                    if not feed.is_complete:  # the job may have ended after the events were read: read them again
                        await feed.catch_up(self.reads, job_id, force=True, batch=self.read_batch)
                        position = feed.position_after(after_key, position)
                        new = feed.events[position:]
                    if not new:
                        return
                # a wake-up that brings this follower nothing (its position is past what the feed reads: a resume
                # past the job's events) has the next pass read the job's status; a feed held from the job's start
                # will hold its final event
                check_finished = not new and not feed.is_from_start
                final = next((i for i, event in enumerate(new) if event.type.is_final), None)
                if final is not None:
                    new = new[: final + 1]  # nothing after a final event
                if new:
                    after_key = wake.after_key = new[-1].key
                    position += len(new)
                    yield list(new)
                    if final is not None:
                        return
                feed.trim(self.trim_events)
                if feed.is_stale and new:  # a read that stopped at its batch: read on before waiting
                    continue
                wake.ticked, wake.waiting_since_s = False, time.monotonic()
                await wake.wait()
                if wake.ticked and not wake.is_closed:
                    check_finished = True
                    yield [None]

    async def _read_range(self, job_id: str, after_id: str, last_id: str) -> AsyncGenerator[Event, None]:
        """The job's events after `after_id` up to `last_id`, read from its event stream in Redis."""
        while True:
            batch = await read_events(self.reads, job_id, after_id, last_id, count=self.read_batch)
            for event in batch:
                yield event
            if len(batch) < self.read_batch:
                return
            after_id = batch[-1].id

    async def _is_finished(self, job_id: str) -> bool:
        status: str | None = await self.redis.hget(keys.job_hash(job_id), "status")  # type: ignore[assignment]
        return status is None or JobStatus(status).is_terminal


def sse_frame(event: Event | None) -> bytes:
    if event is None:
        return b": keepalive\n\n"
    return f"id: {event.id}\nevent: {event.type.value}\ndata: {event.data}\n\n".encode()
