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
from gateway.listing import live_page, remember, unknown_cursor, unlist
from shared import keys
from shared.file_schemas import (
    FileObject,
    batch_file_ids,
    batch_file_record,
    batch_file_row,
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
    async def num_files(self, owner: str, limit: int) -> int:
        """The owner's files (for its quota of `limit`). At the limit, the listing is first rid of the files of
        batches that expired since (a listing drops those only as its pages meet them)."""
        index = keys.files_of(owner)
        count = int(await self.redis.zcard(index))
        if count < limit:
            return count
        rows: list[tuple[str, float]] = await self.redis.zrange(index, 0, -1, withscores=True)  # type: ignore[assignment]
        batch_files = [(file_id, score, parsed[0]) for file_id, score in rows if (parsed := parse_batch_file_id(file_id))]
        pipe = self.redis.pipeline(transaction=False)
        for _, _, batch_id in batch_files:
            pipe.exists(keys.batch_hash(batch_id))
        gone = [(file_id, score) for (file_id, score, _), exists in zip(batch_files, await pipe.execute(), strict=True)
                if not exists]  # fmt: skip
        await unlist(self.redis, index, gone)
        return count - len(gone)

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

    async def page(
        self, limit: int, after: str | None, index: str, purpose: str | None = None
    ) -> tuple[list[dict[str, str]], bool]:
        """Up to `limit` files of `index` (keys.files_of(owner) or keys.FILES_ZSET), newest first, after file
        `after`, of `purpose` if given -> (records, has_more): uploads, and finished batches' output and error
        files (workers/tasks/batch_files.py); 400 for an `after` it does not know."""

        async def records_of(file_ids: list[str]) -> list[dict[str, str] | None]:
            pipe = self.redis.pipeline(transaction=False)
            kinds = []
            for file_id in file_ids:
                parsed = parse_batch_file_id(file_id)
                kinds.append(parsed[1] if parsed else None)
                pipe.hgetall(keys.batch_hash(parsed[0]) if parsed else keys.file_hash(file_id))
            rows = await pipe.execute()
            return [
                (batch_file_record(fields, kind) if fields else None) if kind else (fields or None)
                for fields, kind in zip(rows, kinds, strict=True)
            ]

        def of_purpose(fields: dict[str, str]) -> bool:
            return purpose is None or fields["purpose"] == purpose

        try:
            return await live_page(self.redis, index, after, limit, records_of, of_purpose)
        except LookupError:
            raise unknown_cursor(str(after), "file") from None

    # -- a batch's output and error files ------------------------------------------------------------------------
    async def batch_file(self, file_id: str) -> tuple[dict[str, str], str] | None:
        """(the batch's hash, `output` | `errors`) when `file_id` names a file of a batch that has it, else None."""
        parsed = parse_batch_file_id(file_id)
        if parsed is None:
            return None
        batch_id, kind = parsed
        fields = await self.batches.get(batch_id)
        if fields is None or batch_file_record(fields, kind) is None:  # none of that kind, or deleted
            return None
        return fields, kind

    async def delete_batch_file(self, fields: dict[str, str], kind: str) -> None:
        """Take a batch's output or error file away: out of the listings, and 404 from now on (the batch keeps its
        results: GET /v1/batches/{id}/results)."""
        file_id = batch_file_ids(fields)[kind]
        index = keys.files_of(fields[keys.OWNER_FIELD]) if fields.get(keys.OWNER_FIELD) else None
        pipe = self.redis.pipeline(transaction=True)
        pipe.hset(keys.batch_hash(fields["id"]), f"{kind}_deleted", "1")
        if index is not None:
            pipe.zscore(index, file_id)
            pipe.zrem(index, file_id)
        replies = await pipe.execute()
        await self.redis.zrem(keys.FILES_ZSET, file_id)  # global (another slot)
        await remember(self.redis, file_id, replies[1] if index is not None else None)

    async def batch_lines(self, fields: dict[str, str], kind: str) -> AsyncIterator[str]:
        """The batch's result lines (JSONL, each ending in a newline) that belong to its `kind` file."""
        async for chunk in self.batches.results(fields["id"], int(fields["total"])):
            for line in chunk.decode().splitlines():
                if is_result_of_kind(line, kind):
                    yield line + "\n"

    async def batch_file_object(self, fields: dict[str, str], kind: str) -> FileObject:
        """The file object of a file batch_file() found."""
        record = batch_file_row(fields, kind)
        if not fields.get(f"{kind}_bytes"):  # a batch finalized before files were sized (batch_files.py)
            num_bytes = 0
            async for line in self.batch_lines(fields, kind):
                num_bytes += len(line.encode())
            record["bytes"] = str(num_bytes)
        return file_from_fields(record)

