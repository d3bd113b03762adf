"""The worker's control channels: cancels (keys.CANCEL_CHANNEL: a job id) and "a job was queued"
(keys.QUEUED_CHANNEL: its priority and queue entry), read between engine steps.

    take():  poll(0) on the subscription's socket -> nothing there: return at once (one system call)
                                                  -> else every message redis-py has, until it has none

redis-py's get_message(timeout=0) goes through its pubsub, connection and parser layers to find that nothing
came: ~20-30 us a step right after an engine step had left the caches cold (2026-12-04), for a channel that is
quiet almost always. A drain leaves redis-py's read buffer empty, so a socket with nothing to read means no
message is waiting. get_message also answers None for a message it consumed and dropped (a subscribe
confirmation, a health-check PONG), so a drain ends only when the connection itself has nothing left
(`can_read`): otherwise a cancel read into the buffer together with such a message would wait there unseen.
At least every `full_check_interval_s` the loop asks redis-py itself (its reconnects and health checks run on
that path).
"""

import select
import time
from dataclasses import dataclass, field

import redis

from shared import keys
from shared.lua import entry_key
from shared.schemas import Priority

FULL_CHECK_INTERVAL_S = 1.0  # ask redis-py at least this often, whatever the socket says
MAX_DRAIN_READS = 10_000  # a drain gives up after this many reads (the next take, or full check, goes on)


@dataclass
class ControlMessages:
    cancelled: set[str] = field(default_factory=set)  # job ids
    # queues where a job was queued -> the newest stream entry announced there (None: one came without its entry)
    queued: dict[Priority, str | None] = field(default_factory=dict)

    def add_queued(self, announced: dict[Priority, str | None]) -> None:
        """Per queue the newest entry announced; one announced without its entry leaves none (None)."""
        for priority, entry in announced.items():
            if priority not in self.queued:
                self.queued[priority] = entry
                continue
            held = self.queued[priority]
            self.queued[priority] = None if entry is None or held is None else max(entry, held, key=entry_key)


def queued_of(payload: object) -> dict[Priority, str | None]:
    """The queue and stream entry a QUEUED_CHANNEL message names (the SUBMIT and REQUEUE scripts publish
    "<priority> <entry id>"); a priority alone has no entry, and a payload that names no queue names them all."""
    priority, _, entry = str(payload).partition(" ")
    try:
        queue = Priority(priority)
    except ValueError:
        return dict.fromkeys(Priority)
    try:
        entry_key(entry)
    except ValueError:  # none, or not an entry id
        return {queue: None}
    return {queue: entry}


class ControlChannel:
    def __init__(self, client: redis.Redis, full_check_interval_s: float = FULL_CHECK_INTERVAL_S) -> None:
        self._pubsub = client.pubsub(ignore_subscribe_messages=True)
        self._poller = select.poll()
        self._fd = -1  # the socket registered in _poller (redis-py opens a new one when it reconnects)
        self.full_check_interval_s = full_check_interval_s
        self._next_full_check_s = 0.0

    def subscribe(self) -> None:
        self._pubsub.subscribe(keys.CANCEL_CHANNEL, keys.QUEUED_CHANNEL)

    def take(self) -> ControlMessages:
        """The messages that came since the last call (RedisError when the subscription's connection failed)."""
        taken = ControlMessages()
        if not self._may_have_messages():
            return taken
        self._next_full_check_s = time.monotonic() + self.full_check_interval_s
        for _ in range(MAX_DRAIN_READS):
            message = self._pubsub.get_message(timeout=0.0)
            if message is None:  # nothing, or a message redis-py dropped: more may sit in its buffer
                connection = self._pubsub.connection
                if connection is None or not connection.can_read(timeout=0):
                    break
            elif message["channel"] == keys.QUEUED_CHANNEL:
                taken.add_queued(queued_of(message["data"]))
            else:
                taken.cancelled.add(str(message["data"]))
        return taken

    def close(self) -> None:
        self._pubsub.close()

    def _may_have_messages(self) -> bool:
        """False only when the subscription's socket has nothing to read and a full check is not due."""
        connection = self._pubsub.connection
        sock = getattr(connection, "_sock", None) if connection is not None else None
        if sock is None or time.monotonic() >= self._next_full_check_s:
            return True
        fd = sock.fileno()
        if fd != self._fd:
            if self._fd >= 0:
                self._poller.unregister(self._fd)
            self._poller.register(fd, select.POLLIN)
            self._fd = fd
            return True
        return bool(self._poller.poll(0))
