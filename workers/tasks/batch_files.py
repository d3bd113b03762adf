"""A finished batch's output and error files join its owner's file listing (GET /v1/files, purpose
`batch_output`), as OpenAI lists them. At finalize each file is sized once (its result lines' bytes, kept in the
batch hash as `<kind>_bytes`) and its id is added to the owner's listing and to the admin's, scored by the
batch's end. The files stay views of the batch's results (gateway/file_store.py): they leave the listing when
the batch expires (batch_result_ttl_s) or when one is deleted (the batch hash's `<kind>_deleted`)."""

import redis

from shared import keys
from shared import redis_url as redis_urls
from shared.file_schemas import batch_ended_s, batch_file_ids, is_result_of_kind

RESULTS_PER_READ = 1000


def list_batch_files(client: redis.Redis, batch_id: str) -> None:
    fields: dict[str, str] = client.hgetall(keys.batch_hash(batch_id))  # type: ignore[assignment]
    ids = batch_file_ids(fields) if fields else {}
    if not ids:
        return
    sizes = dict.fromkeys(ids, 0)
    total = int(fields["total"])
    for start in range(0, total, RESULTS_PER_READ):
        indexes = [str(i) for i in range(start, min(total, start + RESULTS_PER_READ))]
        lines: list[str | None] = client.hmget(keys.batch_results(batch_id), indexes)  # type: ignore[assignment]
        for line in lines:
            if line is not None:
                kind = "output" if is_result_of_kind(line, "output") else "errors"
                sizes[kind] = sizes.get(kind, 0) + len(line.encode()) + 1  # JSONL: the line and its newline
    ended_s = batch_ended_s(fields)
    listed = {file_id: ended_s for file_id in ids.values()}
    pipe = redis_urls.pipeline(client, transaction=True, partition=keys.partition_of(batch_id))
    pipe.hset(keys.batch_hash(batch_id), mapping={f"{kind}_bytes": sizes[kind] for kind in ids})  # type: ignore[arg-type]
    if owner := fields.get(keys.OWNER_FIELD):
        pipe.zadd(keys.files_of(owner), listed)  # type: ignore[arg-type]
    pipe.execute()
    client.zadd(keys.FILES_ZSET, listed)  # type: ignore[arg-type]  # global (another slot): a second step
