"""Idempotency-Keys of the creates that are not jobs (a batch, an uploaded file): per API key, the key names the
object its first request made and a digest of what that request sent (jobs keep theirs in the SUBMIT script).

A create WATCHes the key, reads it and, when it names nothing yet, sets it in the same MULTI that makes the object:
two retries racing make one object; the one whose EXEC fails reads the other's answer (`claim` again). The same key
with another input is IdempotencyConflict (a 422 naming the object it made)."""

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.client import Pipeline

from shared import keys


@dataclass(frozen=True)
class Idempotency:
    key: str  # keys.created_by(...)
    digest: str  # of everything the request makes the object from
    ttl_s: int

    @classmethod
    def of(cls, header: str | None, kind: str, owner: str, made_of: list[Any], ttl_s: int) -> "Idempotency | None":
        """None without the header; `made_of`: JSON-able parts (bytes go in as their sha256)."""
        if header is None:
            return None
        parts = [hashlib.sha256(p).hexdigest() if isinstance(p, bytes) else p for p in made_of]
        digest = hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:32]
        return cls(keys.created_by(kind, owner, header), digest, ttl_s)


class IdempotencyConflict(Exception):
    def __init__(self, object_id: str, why: str = "was already used for a different request") -> None:
        self.object_id = object_id
        super().__init__(f"this Idempotency-Key {why} ({object_id})")


def _made(value: str | None, idempotency: Idempotency) -> str | None:
    if value is None:
        return None
    object_id, _, digest = value.partition(":")
    if digest != idempotency.digest:
        raise IdempotencyConflict(object_id)
    return object_id


async def made_by(redis: Redis, idempotency: Idempotency) -> str | None:
    """The object this key made (IdempotencyConflict: from another input); None: none yet."""
    return _made(await redis.get(idempotency.key), idempotency)  # type: ignore[arg-type]  # decoded


async def claim(pipe: Pipeline, idempotency: Idempotency, object_id: str) -> str | None:
    """On a transaction pipeline: the object the key made already (the pipeline reset: make nothing), else None with
    the pipeline in MULTI and the key set to `object_id`, made in the same EXEC (WatchError: a racing request
    made it first; claim again)."""
    await pipe.watch(idempotency.key)
    made = _made(await pipe.get(idempotency.key), idempotency)  # type: ignore[arg-type]  # decoded
    if made is not None:
        await pipe.reset()
        return made
    pipe.multi()
    pipe.set(idempotency.key, f"{object_id}:{idempotency.digest}", ex=idempotency.ttl_s)
    return None
