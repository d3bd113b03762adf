"""Redis commands from concurrent requests, sent together: the submit's script call (AUTH_ADMIT_SUBMIT), the
SSE streams' event reads (XRANGE), and the reads of a request's key, job or batch (gateway/auth.py, store.py).

Under load much of a gateway's CPU is not Python but the socket: one write to Redis and one read of its reply per
command. The commands issued in one turn of the event loop (the requests that arrived together, the streams that
one engine step woke) go out as ONE pipelined write and come back in one read; each caller still gets its own
reply, or its own error. A command alone (no concurrency) is sent at once, so an idle gateway adds no wait.
At most MAX_IN_FLIGHT batches are out at once; the commands issued meanwhile go in the next batch when one comes
back. So a burst of thousands of requests (SSE clients connecting at once) holds MAX_IN_FLIGHT batches a batcher,
not a connection a request: none waits for a free one in the pool (a wait that times out is a 503), and the
larger the burst, the larger each batch. The batches travel on the process's own command connection
(gateway/redis_wire.py: pipelined, replies parsed as they arrive) when it has one; on a Cluster, or without one,
each on a connection of redis-py's pool.

An `eager` batcher (the submits') writes each call at once on the command connection instead, while fewer than
MAX_EAGER_IN_FLIGHT of its calls are out: requests that arrive together (the clients of the streams one engine
step ended, sending their next) are handled one after the other in one loop turn, so a batch of their submits
left only once the last of them was handled (~0.3 ms of Python each), and every job of the wave was created that
much later; written at once, Redis creates each job while the gateway handles the next request. Beyond the bound
(a flood) the calls go in the turn's batch again. On redis-py's pool (a Cluster; a Redis before 6.0) an eager
batcher batches as the others do: a call at once there would hold a pooled connection each.

Pipelining changes how the commands travel, not what each does: each script call stays one atomic run.
"""

import asyncio
import hashlib
import logging
from dataclasses import dataclass, field

from redis.asyncio import Redis
from redis.exceptions import NoScriptError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from gateway.redis_wire import Sent, WireConnection, WireUnsupported

log = logging.getLogger(__name__)

MAX_IN_FLIGHT = 2  # batches sent and not yet answered: one being answered while the next is on its way
MAX_EAGER_IN_FLIGHT = 16  # an eager batcher's calls written at once and not answered yet, at most
# a batch unanswered this long fails (503, as the pool's wait for a connection does) and frees its slot: a Redis
# that stopped answering must not hold every later call of the process behind it
REPLY_TIMEOUT_S = 10.0


@dataclass
class _Call:
    command: tuple[str | int, ...]
    reply: "asyncio.Future[object]" = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class CommandBatcher:
    """`await batcher.call("XRANGE", key, ...)` -> the command's reply, as `redis.execute_command` gives it."""

    def __init__(
        self,
        redis: Redis,
        reply_timeout_s: float = REPLY_TIMEOUT_S,
        wire: WireConnection | None = None,
        eager: bool = False,
    ) -> None:
        self.redis = redis
        self.reply_timeout_s = reply_timeout_s
        self.wire = wire  # the process's command connection (gateway/redis_wire.py); None: redis-py's client
        self.eager = eager  # each call written at once on `wire` (the module's docstring)
        # the reply tasks of calls written at once and not answered yet (referenced: the loop keeps weak ones)
        self._eager_out: set[asyncio.Task[None]] = set()
        self._waiting: list[_Call] = []  # commands not sent yet: they go in the next batch
        self._sending: set[asyncio.Task[None]] = set()  # batches out (referenced: the loop keeps weak references)
        self._is_flush_due = False  # a flush is scheduled for this loop turn
        self.num_sends = 0  # writes to Redis so far (a batch counts once): what the tests look at
        self.num_calls = 0

    async def call(self, *command: str | int) -> object:
        call = _Call(command)
        if not self._write_now(call):
            self._enqueue([call])
        return await call.reply

    def _write_now(self, call: _Call) -> bool:
        """An eager batcher's call, written on the wire now (its reply awaited by a task of its own, as a batch's:
        a caller cancelled meanwhile leaves the connection alone) -> whether it was."""
        if not self.eager or self.wire is None or not self.wire.is_usable:
            return False
        if len(self._eager_out) >= MAX_EAGER_IN_FLIGHT:
            return False
        sent = self.wire.send_now([call.command])
        if sent is None:  # not connected: the batch connects
            return False
        task = asyncio.get_running_loop().create_task(self._send([call], sent))
        self._eager_out.add(task)
        task.add_done_callback(self._eager_out.discard)
        return True

    async def calls(self, *commands: tuple[str | int, ...]) -> list[object]:
        """Several commands in this turn's batch -> their replies in order (the first error is raised)."""
        batch = [_Call(command) for command in commands]
        self._enqueue(batch)
        return list(await asyncio.gather(*(call.reply for call in batch)))  # futures: no task each

    def _enqueue(self, batch: list[_Call]) -> None:
        self._waiting += batch
        self._schedule_flush()

    def _schedule_flush(self) -> None:
        """Send what waits at the end of this loop turn (once the turn's other calls are in), unless MAX_IN_FLIGHT
        batches are out: then when one comes back."""
        if self._waiting and not self._is_flush_due and len(self._sending) < MAX_IN_FLIGHT:
            self._is_flush_due = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._is_flush_due = False
        batch, self._waiting = self._waiting, []
        task = asyncio.get_running_loop().create_task(self._send(batch))
        self._sending.add(task)
        task.add_done_callback(self._sent)

    def _sent(self, task: "asyncio.Task[None]") -> None:
        self._sending.discard(task)
        self._schedule_flush()

    async def _send(self, batch: list[_Call], sent: Sent | None = None) -> None:
        """The batch's replies to its callers; `sent`: its commands are on the wire already (an eager call)."""
        self.num_sends += 1
        self.num_calls += len(batch)
        try:
            try:
                async with asyncio.timeout(self.reply_timeout_s):  # a cancelled command drops its connection
                    replies = await self._run(batch, sent)
            except TimeoutError as exc:
                raise RedisTimeoutError(f"Redis did not answer within {self.reply_timeout_s:g} s") from exc
        except BaseException as exc:  # the connection failed: every call of the batch sees it
            for call in batch:
                if not call.reply.done():
                    call.reply.set_exception(exc)
            if not isinstance(exc, Exception):
                raise
            return
        for call, reply in zip(batch, replies, strict=True):
            if call.reply.done():  # its request was cancelled meanwhile (the command ran all the same)
                continue
            if isinstance(reply, Exception):
                call.reply.set_exception(reply)
            else:
                call.reply.set_result(reply)

    async def _run(self, batch: list[_Call], sent: Sent | None = None) -> list[object]:
        """Each call's reply, or its error."""
        if sent is not None:
            assert self.wire is not None
            return await self.wire.replies([call.command for call in batch], sent)
        if self.wire is not None and self.wire.is_usable:
            try:
                return await self.wire.execute([call.command for call in batch])
            except WireUnsupported as exc:  # a Redis before 6.0: this batch and the next go through redis-py
                log.warning("%s", exc)
        if len(batch) == 1:
            try:
                return [await self.redis.execute_command(*batch[0].command)]
            except ResponseError as exc:  # the command's own error (a failed connection's is raised)
                return [exc]
        pipe = self.redis.pipeline(transaction=False)
        for call in batch:
            pipe.execute_command(*call.command)
        return list(await pipe.execute(raise_on_error=False))


class ScriptBatcher(CommandBatcher):
    """`await batcher.run(keys, args)` -> the script's reply, as redis-py's registered Script gives it; a Redis
    that lost its scripts (a restart) gets the script, then the calls it refused again."""

    def __init__(
        self,
        redis: Redis,
        script: str,
        reply_timeout_s: float = REPLY_TIMEOUT_S,
        wire: WireConnection | None = None,
        eager: bool = False,
    ) -> None:
        super().__init__(redis, reply_timeout_s, wire, eager)
        self.script = script
        self.sha = hashlib.sha1(script.encode()).hexdigest()

    async def run(self, keys: list[str], args: list[str | int]) -> object:
        return await self.call("EVALSHA", self.sha, len(keys), *keys, *args)

    async def _run(self, batch: list[_Call], sent: Sent | None = None) -> list[object]:
        replies = await super()._run(batch, sent)
        refused = [i for i, reply in enumerate(replies) if isinstance(reply, NoScriptError)]
        if refused:
            await self.redis.script_load(self.script)
            for i, reply in zip(refused, await super()._run([batch[i] for i in refused]), strict=True):
                replies[i] = reply
        return replies
