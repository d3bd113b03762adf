"""Dead letters on a real Redis: a job whose worker dies past max_deliveries is listed by `specfleet dlq list`,
`retry` re-enqueues it with its partial output and a real worker loop (tiny target) resumes and finishes it;
`purge` empties the list; retrying a job that is not a dead letter changes nothing; a retried batch line
counts its new result in a running batch, and a finished batch keeps the failure."""

import json
import os
import subprocess
import sys
from pathlib import Path

import redis

from shared import keys
from shared.batch_format import BATCH_ID_KEY, BATCH_LINE_KEY, CUSTOM_ID_KEY
from shared.dlq import DeadLetters
from shared.settings import ServiceSettings
from tests.helpers.engine_worker import EngineThread
from tests.helpers.played_worker import PlayedWorker
from tests.helpers.redis_fixtures import job_record, submit_job
from tests.helpers.waiting import wait_until
from workers.tasks.outbox import OutboxHandler
from workers.worker.queue_reader import QueueReader

ROOT = Path(__file__).resolve().parents[2]
PARTIAL = [5, 6, 7]  # tokens the dying worker wrote before it died


def dlq_cli(redis_url: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECFLEET_")}
    return subprocess.run([sys.executable, "-m", "shared.cli", "dlq", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env={**env, "REDIS_URL": redis_url})


def dead_letter(rclient: redis.Redis, settings: ServiceSettings, count: int, **request: object) -> list[str]:
    """`count` jobs that each ran once (writing PARTIAL) on a worker that then died: past max_deliveries 1."""
    request = {"max_tokens": 12, "temperature": 0, "ignore_eos": True, **request}
    job_ids = [submit_job(rclient, settings, **request) for _ in range(count)]
    dying = PlayedWorker(rclient, settings, "dying")
    for _ in job_ids:
        dying.emit(dying.take(), PARTIAL, "abc")
    survivor = QueueReader(rclient, settings, "survivor")
    wait_until(lambda: survivor.pull(count) == [] and rclient.xlen(keys.DEAD_LETTER_STREAM) == count,
               what="the reclaim to dead-letter the jobs")
    return job_ids


def test_list_retry_resume_and_purge(
    settings: ServiceSettings, rclient: redis.Redis, redis_url: str, tiny_target: Path
) -> None:
    settings.max_deliveries = 1
    retried, purged = dead_letter(rclient, settings, 2)
    failed = job_record(rclient, retried)
    assert failed["status"] == "failed" and "max_deliveries_exceeded" in failed["error"]

    listed = dlq_cli(redis_url, "list", "--json")
    assert listed.returncode == 0, listed.stderr
    letters = {d["job_id"]: d for d in json.loads(listed.stdout)}
    assert letters.keys() == {retried, purged}
    assert letters[retried]["status"] == "failed" and letters[retried]["completion_tokens"] == len(PARTIAL)

    assert dlq_cli(redis_url, "retry", retried).stdout.strip() == f"requeued {retried}"
    queued = job_record(rclient, retried)
    assert queued["status"] == "queued" and "error" not in queued and queued["deliveries"] == "0"
    assert rclient.ttl(keys.job_hash(retried)) == -1  # its result TTL is lifted until it finishes again
    assert [d.job_id for d in DeadLetters(rclient, settings).list()] == [purged]

    worker = EngineThread(settings, tiny_target, worker_id="resumer", model_name="tiny", max_num_seqs=2).start()
    try:
        done = wait_until(lambda: (f := job_record(rclient, retried))["status"] == "succeeded" and f,
                          what="the retried job to finish")
    finally:
        worker.stop()
    token_ids = [int(t) for t in done["token_ids"].split(",")]
    assert token_ids[: len(PARTIAL)] == PARTIAL and len(token_ids) == 12  # resumed after its partial output
    assert int(done["completion_tokens"]) == 12 and done["text"].startswith("abc")

    again = dlq_cli(redis_url, "retry", retried)  # it succeeded: not a dead letter any more
    assert again.returncode == 1 and "max_deliveries_exceeded" in again.stderr
    assert rclient.hget(keys.job_hash(retried), "status") == "succeeded"

    assert dlq_cli(redis_url, "purge", "--yes").stdout.strip() == "purged 1 dead letters"
    assert DeadLetters(rclient, settings).list() == []
    assert rclient.hget(keys.job_hash(purged), "status") == "failed"  # purging forgets the letter, not the job


def test_retried_batch_line_counts_its_new_result_not_its_failure(
    settings: ServiceSettings, rclient: redis.Redis, redis_url: str, tiny_target: Path
) -> None:
    """A running batch whose line 0 was dead-lettered: the retry un-counts the failure, and the resumed job's
    success is what the batch counts (through the outbox handler's real LINE_DONE path)."""
    settings.max_deliveries = 1
    batch_id = "batch_dlq"
    # a batch line's job, as the expansion task submits it (SUBMIT keeps the metadata apart from the request)
    job_id = dead_letter(rclient, settings, 1, metadata={BATCH_ID_KEY: batch_id, BATCH_LINE_KEY: "0",
                                                         CUSTOM_ID_KEY: "a"})[0]  # fmt: skip
    line = {"custom_id": "a", "url": "/v1/jobs", "model": "tiny", "request": {"prompt": "hello", "max_tokens": 12}}
    rclient.rpush(keys.batch_lines(batch_id), json.dumps(line), json.dumps({**line, "custom_id": "b"}))
    rclient.hset(keys.batch_hash(batch_id), mapping={"id": batch_id, "status": "in_progress", "total": 2,
                                                      "completed": 0, "failed": 0, "num_expired": 0,
                                                      "expanded": 2, "expansion": "done"})
    handler = OutboxHandler(rclient, "http://gateway")
    assert handler.settle_batch_line(batch_id, 0, job_id)  # the dead letter counted as the line's failure
    assert rclient.hget(keys.batch_hash(batch_id), "failed") == "1"

    retried = dlq_cli(redis_url, "retry", job_id)
    assert retried.returncode == 0 and f"its line in {batch_id} now waits" in retried.stdout, retried.stderr
    assert rclient.hget(keys.batch_hash(batch_id), "failed") == "0"
    assert not rclient.hexists(keys.batch_results(batch_id), "0")

    worker = EngineThread(settings, tiny_target, worker_id="resumer", model_name="tiny", max_num_seqs=2).start()
    try:
        wait_until(lambda: rclient.hget(keys.job_hash(job_id), "status") == "succeeded",
                   what="the retried batch line's job to finish")
    finally:
        worker.stop()
    assert handler.settle_batch_line(batch_id, 0, job_id)
    batch = rclient.hgetall(keys.batch_hash(batch_id))
    assert (batch["completed"], batch["failed"]) == ("1", "0")
    assert json.loads(rclient.hget(keys.batch_results(batch_id), "0"))["error"] is None


def test_retry_of_a_line_of_a_finished_batch_says_the_batch_keeps_the_failure(
    settings: ServiceSettings, rclient: redis.Redis, redis_url: str
) -> None:
    settings.max_deliveries = 1
    job_id = dead_letter(rclient, settings, 1, metadata={BATCH_ID_KEY: "batch_done", BATCH_LINE_KEY: "0",
                                                         CUSTOM_ID_KEY: "a"})[0]  # fmt: skip
    rclient.hset(keys.batch_hash("batch_done"), mapping={"id": "batch_done", "status": "completed", "failed": 1})
    rclient.hset(keys.batch_results("batch_done"), "0", "{}")
    retried = dlq_cli(redis_url, "retry", job_id)
    assert retried.returncode == 0 and "batch batch_done is completed" in retried.stderr
    assert rclient.hget(keys.batch_hash("batch_done"), "failed") == "1"  # its files are written: unchanged
    assert rclient.hget(keys.job_hash(job_id), "status") == "queued"  # the job itself runs again
