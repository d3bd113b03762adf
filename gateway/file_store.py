"""The gateway's Redis side of OpenAI's Files API: uploaded files (record + bytes), per tenant, and the views
of a finished batch's output and error files (shared/file_schemas.py).

An uploaded file is one MULTI in its tenant's partition (shared/keys.py): its record hash, its content
(validated UTF-8 JSONL, so stored as text) and its id in the tenant's listing; then its id in the fleet-wide
listing (global: partition 0). Files stay until deleted.
"""

import uuid
from collections.abc import AsyncIterator

from redis.asyncio import Redis
from redis.exceptions import WatchError

from gateway.batch_store import BatchStore
from gateway.idempotency import Idempotency, IdempotencyConflict, claim
from gateway.listing import ids_after, remember, unknown_cursor
from shared import keys
from shared.file_schemas import (
    FileObject,
    batch_file_id,
    batch_file_ids,
    is_result_of_kind,
    parse_batch_file_id,
)


def file_from_fields(fields: dict[str, str]) -> FileObject:
    return FileObject(
        id=fields["id"],
        bytes=int(fields["bytes"]),
        created_at=int(float(fields["created_at"])),
        filename=fields["filename"],
        purpose=fields["purpose"],
    )


class FileStore:
    def __init__(self, redis: Redis) -> None:
        self.redis = redis
        self.batches = BatchStore(redis)

    # -- uploaded files ---------------------------------------------------------------------------------------
    async def num_files(self, owner: str) -> int:
        return int(await self.redis.zcard(keys.files_of(owner)))

    async def create(
        self, text: str, num_bytes: int, filename: str, purpose: str, owner: str,
        idempotency: Idempotency | None = None,  # the owner's Idempotency-Key: a retry answers the same file
    ) -> FileObject:
        file_id = keys.mark(f"file-{uuid.uuid4().hex}", keys.partition_of(owner))  # the tenant's partition
        pipe = self.redis.pipeline(transaction=True)
        if idempotency is not None and (made := await claim(pipe, idempotency, file_id)) is not None:
            record = await self.record(made)
            if record is None:  # deleted since: the key made it, a retry does not make another
                raise IdempotencyConflict(made, "made a file that was deleted since")
            return file_from_fields(record)
        seconds, micros = await self.redis.time()
        created_s = seconds + micros / 1e6
        fields: dict[str, str] = {
            "id": file_id,
            "bytes": str(num_bytes),
            "created_at": repr(created_s),
            "filename": filename,
            "purpose": purpose,
            keys.OWNER_FIELD: owner,
        }
        pipe.hset(keys.file_hash(file_id), mapping=fields)  # type: ignore[arg-type]
        pipe.set(keys.file_content(file_id), text)
        pipe.zadd(keys.files_of(owner), {file_id: created_s})
        try:
            await pipe.execute()
        except WatchError:  # another request with the same key made its file first
            return await self.create(text, num_bytes, filename, purpose, owner, idempotency)
        await self.redis.zadd(keys.FILES_ZSET, {file_id: created_s})  # global (another slot): a second step
        return file_from_fields(fields)

    async def record(self, file_id: str) -> dict[str, str] | None:
        """An uploaded file's record (owner included), or None."""
        fields: dict[str, str] = await self.redis.hgetall(keys.file_hash(file_id))  # type: ignore[misc,assignment]
        return fields or None

    async def text(self, file_id: str) -> str | None:
        value: str | None = await self.redis.get(keys.file_content(file_id))  # type: ignore[assignment]
        return value

    async def delete(self, file_id: str, owner: str) -> bool:
        pipe = self.redis.pipeline(transaction=True)
        pipe.zscore(keys.files_of(owner), file_id)
        pipe.delete(keys.file_hash(file_id), keys.file_content(file_id))
        pipe.zrem(keys.files_of(owner), file_id)
        score, deleted, _ = await pipe.execute()
        await self.redis.zrem(keys.FILES_ZSET, file_id)  # global (another slot); page() skips a deleted file
        await remember(self.redis, file_id, score)  # a page that ended on it continues (gateway/listing.py)
        return bool(deleted)

    async def page(self, limit: int, after: str | None, index: str) -> tuple[list[dict[str, str]], bool]:
        """Up to `limit` files of `index` (keys.files_of(owner) or keys.FILES_ZSET), newest first, after file
        `after` -> (records, has_more); 400 for an `after` it does not know."""
        try:
            rows = await ids_after(self.redis, index, after, limit + 1)
        except LookupError:
            raise unknown_cursor(str(after), "file") from None
        pipe = self.redis.pipeline(transaction=False)
        for file_id, _ in rows:
            pipe.hgetall(keys.file_hash(file_id))
        found = [fields for fields in await pipe.execute() if fields]
        return found[:limit], len(found) > limit

    # -- a batch's output and error files ------------------------------------------------------------------------
    async def batch_file(self, file_id: str) -> tuple[dict[str, str], str] | None:
        """(the batch's hash, `output` | `errors`) when `file_id` names a file of a batch that has it, else None."""
        parsed = parse_batch_file_id(file_id)
        if parsed is None:
            return None
        batch_id, kind = parsed
        fields = await self.batches.get(batch_id)
        if fields is None or batch_file_ids(fields).get(kind) != file_id:
            return None
        return fields, kind

    async def batch_lines(self, fields: dict[str, str], kind: str) -> AsyncIterator[str]:
        """The batch's result lines (JSONL, each ending in a newline) that belong to its `kind` file."""
        async for chunk in self.batches.results(fields["id"], int(fields["total"])):
            for line in chunk.decode().splitlines():
                if is_result_of_kind(line, kind):
                    yield line + "\n"

    async def batch_file_object(self, fields: dict[str, str], kind: str) -> FileObject:
        num_bytes = 0
        async for line in self.batch_lines(fields, kind):
            num_bytes += len(line.encode())
        ended_at = fields.get("completed_at") or fields.get("cancelled_at") or fields.get("expired_at")
        return FileObject(
            id=batch_file_id(fields["id"], kind),
            bytes=num_bytes,
            created_at=int(float(ended_at or fields.get("failed_at") or fields["created_at"])),
            filename=f"{fields['id']}_{kind}.jsonl",
            purpose="batch_output",
        )

