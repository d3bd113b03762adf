"""One Lua script's calls from concurrent requests, sent to Redis together (the submit's AUTH_ADMIT_SUBMIT).

Under load most of a gateway's CPU per submit is not Python but the socket: one write to Redis and one read of
its reply per request. The calls made in one turn of the event loop (the requests that arrived together) go out
as ONE pipelined write and come back in one read; each caller still gets its own reply, or its own error. A call
alone (no concurrency) is sent at once as a plain EVALSHA, so an idle gateway adds no wait.

Each call stays one atomic script run: pipelining changes how the calls travel, not what each does.
"""

import asyncio
import hashlib
from dataclasses import dataclass, field

from redis.asyncio import Redis
from redis.exceptions import NoScriptError


@dataclass
class _Call:
    keys: list[str]
    args: list[str | int]
    reply: "asyncio.Future[object]" = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class ScriptBatcher:
    """`await batcher(keys=..., args=...)` -> the script's reply, like redis-py's registered Script."""

    def __init__(self, redis: Redis, script: str) -> None:
        self.redis = redis
        self.script = script
        self.sha = hashlib.sha1(script.encode()).hexdigest()
        self._waiting: list[_Call] = []  # calls of this loop turn, not sent yet
        self._sending: set[asyncio.Task[None]] = set()  # referenced until done (the loop keeps weak references)
        self.num_sends = 0  # writes to Redis so far (a batch counts once): the tests' and profiles' view
        self.num_calls = 0

    async def __call__(self, keys: list[str], args: list[str | int]) -> object:
        call = _Call(keys, args)
        self._waiting.append(call)
        if len(self._waiting) == 1:  # the first call of this turn sends the turn's calls once the others are in
            asyncio.get_running_loop().call_soon(self._flush)
        return await call.reply

    def _flush(self) -> None:
        batch, self._waiting = self._waiting, []
        task = asyncio.get_running_loop().create_task(self._send(batch))
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)

    async def _send(self, batch: list[_Call]) -> None:
        self.num_sends += 1
        self.num_calls += len(batch)
        try:
            replies = await self._run(batch)
        except BaseException as exc:  # the connection failed: every call of the batch sees it
            for call in batch:
                if not call.reply.done():
                    call.reply.set_exception(exc)
            if not isinstance(exc, Exception):
                raise
            return
        for call, reply in zip(batch, replies, strict=True):
            if call.reply.done():  # its request was cancelled meanwhile (the script ran all the same)
                continue
            if isinstance(reply, Exception):
                call.reply.set_exception(reply)
            else:
                call.reply.set_result(reply)

    async def _run(self, batch: list[_Call]) -> list[object]:
        """Each call's reply or error; a Redis that lost its scripts (a restart) gets the script, then the calls
        it refused again."""
        replies = await self._evalsha(batch)
        refused = [i for i, reply in enumerate(replies) if isinstance(reply, NoScriptError)]
        if refused:
            await self.redis.script_load(self.script)
            for i, reply in zip(refused, await self._evalsha([batch[i] for i in refused]), strict=True):
                replies[i] = reply
        return replies

    async def _evalsha(self, batch: list[_Call]) -> list[object]:
        if len(batch) == 1:
            call = batch[0]
            try:
                return [await self.redis.evalsha(self.sha, len(call.keys), *call.keys, *call.args)]  # type: ignore[misc]
            except NoScriptError as exc:
                return [exc]
        pipe = self.redis.pipeline(transaction=False)
        for call in batch:
            pipe.evalsha(self.sha, len(call.keys), *call.keys, *call.args)
        return list(await pipe.execute(raise_on_error=False))
