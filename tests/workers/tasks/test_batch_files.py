"""A batch's files are listed by the script that ends it, and only when it does (workers/tasks/batch_files.py)."""

import redis

from shared import keys
from shared.batch_state import BatchStatus
from workers.tasks.batch_files import BatchFiles, end_with_files


def test_the_files_are_listed_only_when_the_transition_is_made(rclient: redis.Redis) -> None:
    files = BatchFiles("batch_x", "key_a", {"output": "file-batch_x-output"}, {"output": 120})
    assert end_with_files(rclient, files, BatchStatus.COMPLETED) == "missing"  # expired meanwhile
    assert not rclient.exists(keys.batch_hash("batch_x"), keys.files_of("key_a"), keys.FILES_ZSET)  # no junk hash
    rclient.hset(keys.batch_hash("batch_x"), mapping={"id": "batch_x", "status": "finalizing"})
    assert end_with_files(rclient, files, BatchStatus.COMPLETED) == "ok"
    ended = float(rclient.hget(keys.batch_hash("batch_x"), "completed_at"))
    assert rclient.hget(keys.batch_hash("batch_x"), "output_bytes") == "120"
    assert rclient.zrange(keys.files_of("key_a"), 0, -1, withscores=True) == [("file-batch_x-output", ended)]
    assert rclient.zscore(keys.FILES_ZSET, "file-batch_x-output") == ended
    assert end_with_files(rclient, files, BatchStatus.CANCELLED) == "completed"  # raced: nothing more
