"""The gateway's one pub/sub connection, its replies parsed by hiredis as they come off the socket.

Every event a stream carries arrives here first, so this is the hottest path of a loaded gateway. A reply is
parsed in the transport's `data_received` and handed to the hub's callback in the same loop turn: no task, no
timer and no coroutine per message (redis-py's `PubSub.get_message` spends about as much per message as the
rest of the gateway's work for the event; see the README's "The submit path").

Where it connects: REDIS_URL's data node, with its credentials and TLS. Standalone: its host and port or its
unix socket. Sentinel: the master the sentinels name at each connect. Cluster: a seed node, each connect the
next one (every node of a cluster hears every PUBLISH).

A lost connection (or one that leaves a PING unanswered for a ping interval) is reported (`on_lost`: the hub
has every follower re-read its stream) and made again after `reconnect_s` (doubled, up to RECONNECT_MAX_S, while
connects fail or are refused), subscribing every wanted channel again. Each SUBSCRIBE confirmation is reported
(`on_subscribed`), so a feed re-reads what was published while it was away.
"""

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import hiredis

from gateway.redis_address import address_of
from gateway.redis_wire import pack
from shared import redis_url as redis_urls

log = logging.getLogger(__name__)

RECONNECT_S = 0.5  # pause after a lost connection or a failed connect; doubled while connects keep failing
RECONNECT_MAX_S = 5.0  # ... up to this (a connection that got a SUBSCRIBE confirmed starts over from RECONNECT_S)
PING_INTERVAL_S = 15.0  # a PING after an interval without a reply; still unanswered an interval later: dead


async def cancel(task: asyncio.Task[None] | None) -> None:
    """Cancel `task` (when there is one) and wait until it has ended."""
    if task is None:
        return
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass


class _Protocol(asyncio.Protocol):
    """One connection: bytes in, replies out to `on_reply`, in order."""

    def __init__(self, on_reply: Callable[[Any], None]) -> None:
        self._reader = hiredis.Reader(encoding="utf-8", errors="replace")
        self._on_reply = on_reply
        self.transport: asyncio.Transport | None = None
        self.closed: asyncio.Future[Exception | None] = asyncio.get_running_loop().create_future()
        self.last_reply_s = time.monotonic()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.last_reply_s = time.monotonic()
        self._reader.feed(data)
        while True:
            try:
                reply = self._reader.gets()
            except hiredis.ProtocolError as exc:  # not RESP: nothing more on this connection can be trusted
                log.error("pub/sub: unreadable reply (%s); reconnecting", exc)
                self.close()
                return
            if reply is False:
                return
            self._on_reply(reply)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.closed.done():
            self.closed.set_result(exc)

    def write(self, data: bytes) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.abort()


class Subscriber:
    """`subscribe`/`unsubscribe` channels and `psubscribe` patterns; `on_message(channel, data)` for each message
    published on them; `on_subscribed(channel or pattern)` for each confirmation."""

    def __init__(
        self,
        redis_url: str,
        on_message: Callable[[str, str], None],
        on_subscribed: Callable[[str], None],
        on_lost: Callable[[], None],
        reconnect_s: float = RECONNECT_S,
        ping_interval_s: float = PING_INTERVAL_S,
    ) -> None:
        self.target = redis_urls.parse(redis_url)
        self.on_message = on_message
        self.on_subscribed = on_subscribed
        self.on_lost = on_lost
        self.reconnect_s = reconnect_s
        self.ping_interval_s = ping_interval_s
        self.channels: set[str] = set()  # wanted: subscribed on each (re)connect
        self.patterns: set[str] = set()  # the same, for PSUBSCRIBE
        self.num_connects = 0
        self._num_attempts = 0
        self._is_confirmed = False  # the current connection had a SUBSCRIBE confirmed (it works)
        self._protocol: _Protocol | None = None
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="pubsub")

    async def stop(self) -> None:
        await cancel(self._task)
        if self._protocol is not None:
            self._protocol.close()

    def subscribe(self, *channels: str) -> None:
        self.channels.update(channels)
        if self._protocol is not None:  # else the connect subscribes them
            self._protocol.write(pack([("SUBSCRIBE", *channels)]))

    def psubscribe(self, *patterns: str) -> None:
        self.patterns.update(patterns)
        if self._protocol is not None:
            self._protocol.write(pack([("PSUBSCRIBE", *patterns)]))

    def unsubscribe(self, *channels: str) -> None:
        self.channels.difference_update(channels)
        if self._protocol is not None:
            self._protocol.write(pack([("UNSUBSCRIBE", *channels)]))

    def _on_reply(self, reply: Any) -> None:
        if isinstance(reply, list) and len(reply) >= 3:
            kind = reply[0]
            if kind == "message":
                self.on_message(reply[1], reply[2])
            elif kind == "pmessage" and len(reply) == 4:
                self.on_message(reply[2], reply[3])
            elif kind in ("subscribe", "psubscribe"):
                self._is_confirmed = True
                self.on_subscribed(reply[1])
        elif isinstance(reply, hiredis.ReplyError):  # AUTH refused, a command refused: connect again later
            log.error("pub/sub: redis refused a command: %s", reply)
            if self._protocol is not None:
                self._protocol.close()

    async def _run(self) -> None:
        delay_s = self.reconnect_s
        while True:
            self._is_confirmed = False
            try:
                self._protocol = await self._connect()
            except Exception as exc:  # unreachable, refused, TLS, no master named yet: try again
                log.warning("pub/sub: cannot connect (%s); retrying in %.1fs", exc, delay_s)
                await asyncio.sleep(delay_s)
                delay_s = min(2 * delay_s, RECONNECT_MAX_S)
                continue
            reason = await self._serve(self._protocol)
            self._protocol = None
            delay_s = self.reconnect_s if self._is_confirmed else min(2 * delay_s, RECONNECT_MAX_S)
            log.warning("pub/sub connection lost (%s); every follower re-reads its stream; reconnecting in %.1fs",
                        reason or "closed", delay_s)  # fmt: skip
            self.on_lost()
            await asyncio.sleep(delay_s)

    async def _connect(self) -> _Protocol:
        self._num_attempts += 1
        address = await address_of(self.target, self._num_attempts - 1)
        protocol: _Protocol = await address.open(lambda: _Protocol(self._on_reply))
        self.num_connects += 1
        hello = pack(address.hello())
        if self.channels:
            hello += pack([("SUBSCRIBE", *sorted(self.channels))])
        if self.patterns:
            hello += pack([("PSUBSCRIBE", *sorted(self.patterns))])
        protocol.write(hello)
        return protocol

    async def _serve(self, protocol: _Protocol) -> Exception | None:
        """Until the connection closes: a PING after each interval that heard nothing; closed when a PING is still
        unanswered an interval later. Only an unanswered PING counts: silence while this process's loop stalled
        (replies wait in the socket) is not the connection's."""
        checked_s = time.monotonic()
        ping_sent_s: float | None = None
        while True:
            try:
                async with asyncio.timeout(self.ping_interval_s):
                    return await asyncio.shield(protocol.closed)
            except TimeoutError:
                # the replies that arrived during a stall were read before this timer ran (the loop runs I/O first)
                if ping_sent_s is not None and protocol.last_reply_s < ping_sent_s:
                    log.warning("pub/sub: no reply to a PING for %.1fs; reconnecting", time.monotonic() - ping_sent_s)
                    protocol.close()
                elif protocol.last_reply_s < checked_s:  # heard nothing since the last check
                    protocol.write(pack([("PING",)]))
                    ping_sent_s = time.monotonic()
                else:
                    ping_sent_s = None
                checked_s = time.monotonic()
