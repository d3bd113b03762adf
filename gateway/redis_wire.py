"""The gateway's command connection: the batched commands of one process (gateway/redis_batch.py: the submit's
script call, the reads of keys, jobs and event streams) pipelined on ONE connection, their replies parsed by
hiredis in the transport's `data_received` (as gateway/pubsub.py does for events).

    execute(commands) -> one transport write -> each reply resolves its future, in order -> the replies

redis-py's asyncio client spends ~100 µs of CPU a call around the round trip (the pool's checkout and release,
a pipeline object, a stream read per reply, the retry wrapper): more than Redis takes to run the submit's
script. Here a call costs ~40-60 µs (README, "The submit path").

A reply is what redis-py's client returns for the command (its response callbacks: HGETALL -> dict, XRANGE ->
[(id, fields)]); an error reply is the exception redis-py raises for it (NOSCRIPT -> NoScriptError, else a
ResponseError), in its place. A lost connection fails every command still unanswered with ConnectionError (a
command that was sent may have run: as with redis-py, nothing is retried here), and the next call connects again.
A call cancelled while it waits (the batcher's reply timeout) drops the connection: replies after a gap would
answer the wrong callers. Standalone and Sentinel only (a READONLY reply, from a master demoted by a failover,
drops the connection so the next connect asks the sentinels); on a Cluster the batchers keep redis-py's client,
which sends each command to the node of its slot (`for_url` gives None).
"""

import asyncio
import logging
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

import hiredis
from redis._parsers import BaseParser
from redis.exceptions import AuthenticationError, DataError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from gateway.redis_address import CONNECT_TIMEOUT_S, address_of
from shared import redis_url as redis_urls
from shared.redis_url import RedisTarget, Topology

log = logging.getLogger(__name__)

Command = Sequence[str | int | float | bytes]


def pack(commands: Sequence[Command]) -> bytes:
    """Commands (this connection's, and the pub/sub connection's) as RESP arrays of bulk strings, arguments
    encoded as redis-py encodes them (str as UTF-8, int and float by repr; a bool or other type is a DataError,
    before anything is sent)."""
    parts = []
    for command in commands:
        parts.append(b"*%d\r\n" % len(command))
        for arg in command:
            if isinstance(arg, str):
                data = arg.encode()
            elif isinstance(arg, bytes):
                data = arg
            elif isinstance(arg, int | float) and not isinstance(arg, bool):
                data = repr(arg).encode()
            else:
                raise DataError(f"invalid argument {arg!r} of type {type(arg).__name__}: str, bytes, int or float")
            parts.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(parts)


Sent = tuple["_Protocol", list["asyncio.Future[Any]"]]  # commands written: their connection, their replies to come


class WireUnsupported(RedisConnectionError):
    """The Redis refused HELLO 3 (a version before 6.0): the caller sends through redis-py's client instead."""


class _Protocol(asyncio.Protocol):
    """One connection: each reply resolves the oldest waiting future."""

    def __init__(self) -> None:
        self._reader = hiredis.Reader(encoding="utf-8")
        self.waiters: deque[asyncio.Future[Any]] = deque()
        self.transport: asyncio.Transport | None = None
        self.lost: Exception | None = None  # why the connection ended, once it has

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self._reader.feed(data)
        while True:
            try:
                reply = self._reader.gets()
            except (hiredis.ProtocolError, UnicodeDecodeError) as exc:  # nothing after it can be trusted
                log.error("redis command connection: unreadable reply (%s); dropping it", exc)
                self.abort(RedisConnectionError(f"an unreadable reply from Redis: {exc}"))
                return
            if reply is False:
                return
            waiter = self.waiters.popleft()
            if not waiter.done():  # its caller was cancelled: the connection is being dropped
                waiter.set_result(reply)

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(RedisConnectionError(f"the connection to Redis was lost ({exc or 'closed by the server'})"))

    def _fail(self, error: Exception) -> None:
        """The connection is over: every command not answered yet fails with `error` (the first reason wins)."""
        if self.lost is None:
            self.lost = error
        while self.waiters:
            waiter = self.waiters.popleft()
            if not waiter.done():
                waiter.set_exception(self.lost)

    @property
    def is_open(self) -> bool:
        return self.lost is None and self.transport is not None and not self.transport.is_closing()

    def send(self, data: bytes, num_replies: int) -> list[asyncio.Future[Any]]:
        loop = asyncio.get_running_loop()
        futures = [loop.create_future() for _ in range(num_replies)]
        self.waiters.extend(futures)
        assert self.transport is not None
        self.transport.write(data)
        return futures

    def abort(self, error: Exception) -> None:
        """Drop the connection: the commands not answered yet fail with `error`."""
        self._fail(error)
        if self.transport is not None:
            self.transport.abort()


class WireConnection:
    """`await wire.execute([command, ...])` -> each command's reply, or its error in its place."""

    def __init__(self, target: RedisTarget, callbacks: Mapping[Any, Any]) -> None:
        if target.topology is Topology.CLUSTER:
            raise ValueError("a Cluster's commands go to the nodes of their slots: use redis-py's client")
        self.target = target
        self.callbacks = callbacks  # redis-py's response callbacks, by command name
        self.num_connects = 0
        self.is_usable = True  # False once a Redis refused RESP3 (before 6.0): the batchers use redis-py's client
        self._protocol: _Protocol | None = None
        self._connect_lock = asyncio.Lock()

    @classmethod
    def for_url(cls, redis_url: str, callbacks: Mapping[Any, Any]) -> "WireConnection | None":
        """A command connection for REDIS_URL; None for a Cluster."""
        target = redis_urls.parse(redis_url)
        return None if target.topology is Topology.CLUSTER else cls(target, callbacks)

    async def execute(self, commands: Sequence[Command]) -> list[object]:
        data = pack(commands)
        protocol = await self._connected()
        return await self.replies(commands, (protocol, protocol.send(data, len(commands))))

    def send_now(self, commands: Sequence[Command]) -> "Sent | None":
        """Write `commands` now, before the caller's next wait, when the connection is open; their replies come
        from `replies`. None while there is no open connection (execute() makes one)."""
        protocol = self._protocol
        if protocol is None or not protocol.is_open:
            return None
        return protocol, protocol.send(pack(commands), len(commands))

    async def replies(self, commands: Sequence[Command], sent: "Sent") -> list[object]:
        """Each command's reply (its error in its place) as execute() gives them, of commands written already."""
        protocol, futures = sent
        replies = []
        try:
            for future in futures:
                replies.append(await future)
        except BaseException as exc:
            if isinstance(exc, asyncio.CancelledError):  # the replies still due would answer the wrong callers
                protocol.abort(RedisTimeoutError("an earlier command on the connection went unanswered; dropped"))
            for future in futures:  # this call's failure is the first one raised: the rest are retrieved here
                if future.done() and not future.cancelled():
                    future.exception()
            raise
        return [self._reply(command, reply, protocol) for command, reply in zip(commands, replies, strict=True)]

    def _reply(self, command: Command, reply: Any, protocol: _Protocol) -> object:
        if isinstance(reply, hiredis.ReplyError):
            error = BaseParser.parse_error(str(reply))
            if str(reply).startswith("READONLY"):  # a replica now (failover): the next connect asks the sentinels
                protocol.abort(RedisConnectionError(f"Redis answered {reply}: connecting again"))
            return error
        name = str(command[0]).upper()
        callback = self.callbacks.get(name)
        return callback(reply) if callback is not None else reply

    async def _connected(self) -> _Protocol:
        protocol = self._protocol
        if protocol is not None and protocol.is_open:
            return protocol
        async with self._connect_lock:
            if self._protocol is None or not self._protocol.is_open:
                self._protocol = await self._connect()
            return self._protocol

    async def _connect(self) -> _Protocol:
        try:
            address = await address_of(self.target, self.num_connects)
            protocol: _Protocol = await address.open(_Protocol)
        except (OSError, TimeoutError) as exc:
            raise RedisConnectionError(f"cannot connect to Redis: {exc}") from exc
        self.num_connects += 1
        # RESP3, as redis-py's client speaks it (its callbacks expect RESP3 replies), with the credentials
        hello: list[Command] = [address.hello_resp3()]
        if address.db:
            hello.append(("SELECT", address.db))
        try:
            async with asyncio.timeout(CONNECT_TIMEOUT_S):
                replies = await asyncio.gather(*protocol.send(pack(hello), len(hello)))
        except BaseException as exc:
            protocol.abort(RedisConnectionError(f"Redis did not answer HELLO: {exc!r}"))
            if isinstance(exc, TimeoutError):
                raise RedisConnectionError("Redis did not answer HELLO in time") from exc
            raise
        for command, reply in zip(hello, replies, strict=True):
            if isinstance(reply, hiredis.ReplyError):
                protocol.abort(RedisConnectionError(f"Redis refused {command[0]!s}"))
                text = str(reply)
                if command[0] == "HELLO" and ("unknown command" in text or text.startswith("NOPROTO")):
                    self.is_usable = False
                    raise WireUnsupported(f"this Redis does not speak RESP3 ({text}): redis-py's client is used")
                if text.startswith(("WRONGPASS", "NOAUTH", "NOPERM")):
                    raise AuthenticationError(text)
                error = BaseParser.parse_error(text)
                raise error if isinstance(error, ResponseError) else RedisConnectionError(text)
        return protocol

    def close(self) -> None:
        if self._protocol is not None:
            self._protocol.abort(RedisConnectionError("the gateway closed its connection to Redis"))
            self._protocol = None
