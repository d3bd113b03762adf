"""The gateway's Redis side of batches: create (one MULTI in the owner's partition: batch hash, lines, the
owner's listing, `created` notice; then the global admin listing), read, list, results, cancel. The Celery side
does the rest (workers/tasks/batches.py)."""

import json
import uuid
from collections.abc import AsyncIterator

from redis.asyncio import Redis
from redis.exceptions import WatchError

from gateway.idempotency import Idempotency, claim
from gateway.listing import live_page, unknown_cursor
from shared import batch_lua, batch_quota, keys
from shared.batch_state import BatchStatus
from shared.outbox import BatchEvent, NoticeKind, notice_fields

LINES_PER_PUSH = 1000
RESULTS_PER_READ = 1000


class BatchStore:
    def __init__(self, redis: Redis) -> None:
        self.redis = redis

    async def create(
        self,
        lines: list[str],  # BatchLine.to_json() of each validated line, in input order
        webhook: str | None,
        metadata: dict[str, str],
        window_s: float,
        owner: str = "",  # the API key id the batch (and every job of its lines) belongs to
        fields: dict[str, str] | None = None,  # more hash fields: input_file_id, endpoint, completion_window
        idempotency: Idempotency | None = None,  # the owner's Idempotency-Key: a retry answers the same batch
    ) -> str:
        """-> the batch id: the one `idempotency` made before, if it did (IdempotencyConflict: from another
        input)."""
        partition = keys.partition_of(owner)  # the tenant's (its key id names it); no owner: partition 0
        batch_id = keys.mark(f"batch_{uuid.uuid4().hex}", partition)
        seconds, micros = await self.redis.time()  # the clock every `*_at` of the batch is stamped with
        created_s = seconds + micros / 1e6
        pipe = self.redis.pipeline(transaction=True)
        if idempotency is not None and (made := await claim(pipe, idempotency, batch_id)) is not None:
            return made
        pipe.hset(
            keys.batch_hash(batch_id),
            mapping={
                "id": batch_id,
                "status": BatchStatus.VALIDATING.value,
                "created_at": repr(created_s),
                "expires_at": repr(created_s + window_s),
                "total": len(lines),
                "completed": 0,
                "failed": 0,
                "num_expired": 0,
                "expanded": 0,
                "expansion": "running",
                "webhook": webhook or "",
                "metadata": json.dumps(metadata),
                keys.OWNER_FIELD: owner,
                **(fields or {}),  # type: ignore[dict-item]
            },
        )
        for start in range(0, len(lines), LINES_PER_PUSH):
            pipe.rpush(
                keys.batch_lines(batch_id),
                *lines[start : start + LINES_PER_PUSH],
            )
        if owner:
            pipe.zadd(keys.batches_of(owner), {batch_id: created_s})
        pipe.xadd(
            keys.outbox_stream(partition),
            notice_fields(NoticeKind.BATCH, batch_id, BatchEvent.CREATED.value),  # type: ignore[arg-type]
            maxlen=keys.OUTBOX_MAXLEN,
            approximate=True,
        )
        try:
            await pipe.execute()
        except WatchError:  # another request with the same key made its batch first
            return await self.create(lines, webhook, metadata, window_s, owner, fields, idempotency)
        # the admin listing is global (partition 0: another slot), so a second step after the batch exists; a
        # crash between leaves the batch out of the admin's listing only (page() skips an entry without a batch)
        await self.redis.zadd(keys.BATCHES_ZSET, {batch_id: created_s})
        return batch_id

    async def num_pending_lines(self, owner: str) -> int:
        """Lines of the key's unfinished batches not finished yet (shared/batch_quota.py)."""
        batch_ids: list[str] = await self.redis.zrevrange(keys.batches_of(owner), 0, batch_quota.MAX_BATCHES_COUNTED - 1)  # type: ignore[assignment]
        if not batch_ids:
            return 0
        pipe = self.redis.pipeline(transaction=False)
        for batch_id in batch_ids:
            pipe.hmget(keys.batch_hash(batch_id), batch_quota.FIELDS)
        return batch_quota.count_lines(await pipe.execute()).num_pending

    async def get(self, batch_id: str) -> dict[str, str] | None:
        fields: dict[str, str] = await self.redis.hgetall(keys.batch_hash(batch_id))  # type: ignore[assignment]
        return fields or None

    async def cancel(self, batch_id: str) -> str:
        """-> 'ok' | 'missing' | the batch's current status."""
        result = await self.redis.eval(  # type: ignore[misc]
            batch_lua.CANCEL,
            2,
            keys.batch_hash(batch_id),
            keys.outbox_stream(keys.partition_of(batch_id)),
            batch_id,
            keys.OUTBOX_MAXLEN,
        )
        return str(result)

    async def page(
        self, limit: int, after: str | None, index: str = keys.BATCHES_ZSET
    ) -> tuple[list[dict[str, str]], bool]:
        """Up to `limit` batches of `index` (all, or one key's: keys.batches_of), newest first, after batch
        `after` -> (batches, has_more); one expired after its result TTL leaves the listing (gateway/listing.py);
        400 for an `after` it does not know."""

        async def records_of(batch_ids: list[str]) -> list[dict[str, str] | None]:
            pipe = self.redis.pipeline(transaction=False)
            for batch_id in batch_ids:
                pipe.hgetall(keys.batch_hash(batch_id))
            return [fields or None for fields in await pipe.execute()]

        try:
            return await live_page(self.redis, index, after, limit, records_of)
        except LookupError:
            raise unknown_cursor(str(after), "batch") from None

    async def results(self, batch_id: str, total: int) -> AsyncIterator[bytes]:
        """The result lines written so far, in input order, as JSONL."""
        for start in range(0, total, RESULTS_PER_READ):
            fields = [str(i) for i in range(start, min(total, start + RESULTS_PER_READ))]
            values: list[str | None] = await self.redis.hmget(keys.batch_results(batch_id), fields)  # type: ignore[misc,assignment]
            chunk = "".join(value + "\n" for value in values if value is not None)
            if chunk:
                yield chunk.encode()
