"""The token path on the gateway side: ONE pub/sub connection per process, fanned out to every follower.

A follower (an SSE client, or a `Prefer: wait` submit) subscribes first, then reads the job's event stream
after the last entry id it has, then sleeps until a wake-up; every wake-up (or a keepalive tick, which also
re-reads, covering a lost wake-up or a pub/sub reconnect) re-reads from that id. The event stream is the
truth and pub/sub only says "look again", so nothing is lost, repeated or reordered whatever the timing.
"""

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from shared import keys
from shared.job_state import JobStatus
from shared.schemas import EventType

log = logging.getLogger(__name__)

READ_BATCH = 512  # event-stream entries per XRANGE
SUBSCRIBE_WAIT_S = 2.0  # how long a new follower waits for its SUBSCRIBE to be confirmed
CHANNEL_LINGER_S = 10.0  # a channel without followers is unsubscribed after this


@dataclass
class Event:
    id: str  # entry id in the job's event stream: the SSE `id:`
    type: EventType
    data: str  # json


@dataclass
class _Channel:
    waiters: set[asyncio.Event] = field(default_factory=set)
    subscribed: asyncio.Event = field(default_factory=asyncio.Event)
    idle_since: float | None = None


class EventHub:
    def __init__(self, redis: Redis, keepalive_s: float, linger_s: float = CHANNEL_LINGER_S) -> None:
        self.redis = redis
        self.keepalive_s = keepalive_s
        self.linger_s = linger_s
        self._pubsub = redis.pubsub()
        self._channels: dict[str, _Channel] = {}
        self._task: asyncio.Task[None] | None = None
        self._subscribe_lock = asyncio.Lock()

    @property
    def num_followers(self) -> int:
        return sum(len(ch.waiters) for ch in self._channels.values())

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
                for channel in self._channels.values():
                    for waiter in channel.waiters:
                        waiter.set()
                await asyncio.sleep(0.5)
                continue
            if message is not None:
                self._dispatch(message)
            if time.monotonic() >= next_sweep_s:  # not per message: a sweep visits every channel
                next_sweep_s = time.monotonic() + self.linger_s
                await self._drop_idle_channels()

    def _dispatch(self, message: dict[str, object]) -> None:
        channel = self._channels.get(str(message["channel"]))
        if channel is None:
            return
        if message["type"] == "subscribe":
            channel.subscribed.set()
        elif message["type"] == "message":
            for waiter in channel.waiters:
                waiter.set()

    async def _drop_idle_channels(self) -> None:
        """Unsubscribe channels nobody followed for linger_s (lingering avoids subscribe churn and the
        race of a SUBSCRIBE confirmation arriving for an older subscription of the same channel)."""
        now = time.monotonic()
        idle = [
            name
            for name, ch in self._channels.items()
            if not ch.waiters and ch.idle_since is not None and now - ch.idle_since > self.linger_s
        ]
        for name in idle:
            del self._channels[name]
        if idle:
            await self._pubsub.unsubscribe(*idle)

    @asynccontextmanager
    async def watch(self, job_id: str) -> AsyncIterator[asyncio.Event]:
        """An event set on every wake-up of the job's channel; subscribed (confirmed) before it is yielded."""
        name = keys.job_channel(job_id)
        channel = self._channels.get(name)
        if channel is None:
            channel = self._channels[name] = _Channel()
            await self._subscribe(name)
        waiter = asyncio.Event()
        channel.waiters.add(waiter)
        channel.idle_since = None
        try:
            try:
                await asyncio.wait_for(channel.subscribed.wait(), SUBSCRIBE_WAIT_S)
            except TimeoutError:
                log.warning("no SUBSCRIBE confirmation for %s; relying on keepalive re-reads", name)
            yield waiter
        finally:
            channel.waiters.discard(waiter)
            if not channel.waiters:
                channel.idle_since = time.monotonic()

    async def follow(self, job_id: str, after_id: str = "0-0") -> AsyncGenerator[Event | None, None]:
        """The job's events after `after_id`, in order, ending with its final event; None is a keepalive tick."""
        events_key = keys.job_events(job_id)
        check_finished = True  # on the first read and after each tick: a resume after the final event ends
        async with self.watch(job_id) as wake:
            while True:
                wake.clear()
                entries: list[tuple[str, dict[str, str]]] = await self.redis.xrange(  # type: ignore[assignment]
                    events_key, min=f"({after_id}", max="+", count=READ_BATCH
                )
                if not entries and check_finished and await self._is_finished(job_id):
                    return
                check_finished = False
                for entry_id, fields in entries:
                    after_id = entry_id
                    event = Event(id=entry_id, type=EventType(fields["type"]), data=fields["data"])
                    yield event
                    if event.type.is_final:
                        return
                if len(entries) == READ_BATCH:
                    continue
                try:
                    await asyncio.wait_for(wake.wait(), self.keepalive_s)
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
