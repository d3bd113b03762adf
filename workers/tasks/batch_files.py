"""A finished batch's output and error files join its owner's file listing (GET /v1/files, purpose
`batch_output`), as OpenAI lists them. The finalize task sizes each file once (its result lines' bytes, kept in
the batch hash as `<kind>_bytes`); the batch's final transition lists them in the same script
(shared/batch_lua.py END_WITH_FILES), so a client that sees the batch ended finds its files listed; the admin's
listing follows (another slot). The files stay views of the batch's results (gateway/file_store.py): they leave
the listing when the batch expires (batch_result_ttl_s) or when one is deleted (the batch hash's
`<kind>_deleted`)."""

from dataclasses import dataclass

import redis

from shared import batch_lua, keys
from shared.batch_state import BatchStatus
from shared.file_schemas import batch_file_ids, is_result_of_kind

RESULTS_PER_READ = 1000


@dataclass
class BatchFiles:
    batch_id: str
    owner: str
    ids: dict[str, str]  # kind -> file id
    num_bytes: dict[str, int]  # kind -> its lines' bytes


def batch_files(client: redis.Redis, fields: dict[str, str], final: BatchStatus) -> BatchFiles:
    """The files the batch of `fields` (every line settled) has once it ends in `final`, sized."""
    ids = batch_file_ids({**fields, "status": final.value})
    num_bytes = dict.fromkeys(ids, 0)
    total = int(fields["total"])
    for start in range(0, total, RESULTS_PER_READ) if ids else ():
        indexes = [str(i) for i in range(start, min(total, start + RESULTS_PER_READ))]
        lines: list[str | None] = client.hmget(keys.batch_results(fields["id"]), indexes)  # type: ignore[assignment]
        for line in lines:
            if line is not None:
                kind = "output" if is_result_of_kind(line, "output") else "errors"
                if kind in num_bytes:
                    num_bytes[kind] += len(line.encode()) + 1  # JSONL: the line and its newline
    return BatchFiles(fields["id"], fields.get(keys.OWNER_FIELD, ""), ids, num_bytes)


def end_with_files(client: redis.Redis, files: BatchFiles, final: BatchStatus) -> str:
    """The final transition, listing the files when it is made -> 'ok' | 'missing' | the batch's status. The
    admin's listing follows."""
    batch = keys.batch_hash(files.batch_id)
    index = keys.files_of(files.owner) if files.owner else batch
    sizes = [item for kind, n in files.num_bytes.items() for item in (kind, n)]
    listed = list(files.ids.values()) if files.owner else []
    result = str(client.eval(batch_lua.END_WITH_FILES, 2, batch, index, final.value, final.timestamp_field,
                             len(files.num_bytes), *sizes, *listed))  # fmt: skip
    if result == "ok" and files.ids:
        ended = client.hget(batch, final.timestamp_field)
        client.zadd(keys.FILES_ZSET, dict.fromkeys(files.ids.values(), float(str(ended))))  # global: another slot
    return result
