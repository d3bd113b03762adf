"""Batch tasks: expand lines into jobs in chunks, cancel queued lines, finalize. All idempotent, acks_late.

created notice -> expand (one chunk per task, re-enqueued until every line is a job; at most the key's quota of
                 lines queued or running at once: shared/batch_quota.py)
each line's job finishes -> its result line and count (workers/tasks/outbox.py, LINE_DONE)
cancel notice -> cancel (queued lines' jobs cancelled; running ones finish)
ready (see shared/batch_lua.py) -> finalize: fill never-started lines, decide the final status, list its files, webhook

Shared tasks (bound to the app that includes this module), registered with workers/tasks/registry.py for
the outbox bridge: importing this module neither reads settings nor builds the Celery app.
"""

import json
import logging
import time

from celery import shared_task

from shared import batch_lua, batch_quota, keys, lua
from shared import redis_url as redis_urls
from shared.batch_format import BATCH_ID_KEY, BATCH_LINE_KEY, CUSTOM_ID_KEY, BatchLine, unstarted_line
from shared.batch_schemas import batch_from_fields
from shared.batch_state import BatchStatus
from shared.job_state import ErrorCode, JobStatus
from shared.schemas import ErrorEvent, ErrorInfo, Priority, WebhookEvent
from shared.settings import ServiceSettings
from shared.submit import NOT_STORED, StoredForm, body_digest, new_job_id, submit_call
from workers.tasks import batch_files, registry, runtime, webhooks
from workers.tasks.registry import BatchAction

log = logging.getLogger(__name__)

FILL_CHUNK_LINES = 1000
CANCEL_CHUNK_JOBS = 500


def _transition(batch_id: str, to: BatchStatus) -> str:
    return str(
        runtime.redis_client().eval(
            batch_lua.TRANSITION, 1, keys.batch_hash(batch_id), to.value, to.timestamp_field
        )
    )


def _line_call(
    line: BatchLine, batch_id: str, index: int, ttl_s: float, settings: ServiceSettings, ctx: str, owner: str
) -> tuple[list[str], list[str | int]]:
    """The SUBMIT call of a batch line's job: at `batch` priority, with the batch's metadata keys and its window
    as the job's TTL; Idempotency-Key per line (a redelivered task finds the same job). A line whose stored
    request does not validate now is queued as stored: the worker fails its job naming the field."""
    partition = keys.partition_of(batch_id)  # the batch's lines are jobs of its partition (its owner's)
    own = line.request.metadata if line.request is not None else (line.stored_request or {}).get("metadata") or {}
    metadata = {**own, BATCH_ID_KEY: batch_id, BATCH_LINE_KEY: str(index), CUSTOM_ID_KEY: line.custom_id}
    idempotency_key = keys.batch_line_idempotency(batch_id, index)
    if line.request is not None:
        request = line.request.model_copy(update={"metadata": metadata, "ttl_s": ttl_s})
        return submit_call(request, new_job_id(partition), idempotency_key, settings, ctx, owner)
    stored = json.dumps({k: v for k, v in (line.stored_request or {}).items() if k not in NOT_STORED})
    form = StoredForm(stored, Priority.BATCH, ttl_s, metadata, body_digest(stored))
    return submit_call(form, new_job_id(partition), idempotency_key, settings, ctx, owner)


@shared_task(name="specfleet.batches.expand", bind=True, acks_late=True, max_retries=None)
def expand(self: object, batch_id: str) -> str:
    """Submit the next chunk of lines as jobs at `batch` priority (Idempotency-Key per line: a redelivered
    task finds the same jobs), then re-enqueue itself until every line is a job."""
    r, settings = runtime.redis_client(), runtime.settings()
    fields = runtime.hgetall(keys.batch_hash(batch_id))
    if not fields:
        return "missing"
    status = BatchStatus(fields["status"])
    if status is BatchStatus.VALIDATING:
        if _transition(batch_id, BatchStatus.IN_PROGRESS) == "ok":
            reconcile.apply_async((batch_id,), countdown=settings.batch_reconcile_interval_s)
    elif status is BatchStatus.CANCELLING:
        if r.eval(batch_lua.STOP_EXPANSION, 1, keys.batch_hash(batch_id)) == "finalize":
            finalize.delay(batch_id)
        return "stopped"
    elif status is not BatchStatus.IN_PROGRESS or fields.get("expansion") != "running":
        return status.value
    r.hset(keys.batch_hash(batch_id), "expand_ran_at", repr(time.time()))  # reconcile: the chain is alive
    start, total = int(fields["expanded"]), int(fields["total"])
    num_lines = min(settings.batch_chunk_lines, _quota_room(fields.get(keys.OWNER_FIELD, "")))
    if num_lines <= 0 and start < total:  # the key has its quota of lines queued or running: later
        expand.apply_async((batch_id,), countdown=settings.batch_retry_s)
        return "quota"
    raw_lines = runtime.lrange(keys.batch_lines(batch_id), start, min(total, start + num_lines) - 1)
    ttl_s = max(0.001, float(fields["expires_at"]) - time.time())  # past the window: the job expires
    submit = r.register_script(lua.SUBMIT)
    partition = keys.partition_of(batch_id)  # the batch's lines are jobs of its partition (its owner's)
    ctx = lua.context(settings.events_maxlen, settings.result_ttl_s, partition, settings.jobs_listed_per_key)
    pipe = redis_urls.pipeline(r, transaction=False, partition=partition)
    owner = fields.get(keys.OWNER_FIELD, "")  # the batch's owner owns its lines' jobs
    for offset, raw in enumerate(raw_lines):
        keys_, args = _line_call(BatchLine.from_json(raw), batch_id, start + offset, ttl_s, settings, ctx, owner)
        submit(keys=keys_, args=args, client=pipe)
    pairs: list[str] = []
    is_full = False
    for offset, result in enumerate(pipe.execute() if raw_lines else []):
        if result[0] == "full":
            is_full = True
            break
        pairs += [str(start + offset), str(result[1])]
    end = start + len(pairs) // 2
    outcome = str(
        r.eval(
            batch_lua.ADVANCE,
            2,
            keys.batch_hash(batch_id),
            keys.batch_jobs(batch_id),
            start,
            end,
            total,
            *pairs,
        )
    )
    log.info("batch %s: lines %d..%d of %d submitted (%s)", batch_id, start, end, total, outcome)
    if outcome == "more":
        expand.apply_async((batch_id,), countdown=settings.batch_retry_s if is_full else 0)
    elif outcome == "cancelling":
        _cancel_queued(pairs[1::2])
        if r.eval(batch_lua.READY, 1, keys.batch_hash(batch_id)) == "finalize":
            finalize.delay(batch_id)
    elif outcome == "finalize":
        finalize.delay(batch_id)
    return outcome


def _quota_room(owner: str) -> int:
    """Lines the key may still put on the batch queue (shared/batch_quota.py); unlimited without an owner."""
    limit = runtime.settings().batch_max_inflight_lines_per_key
    if not owner or limit == 0:
        return 2**31
    r = runtime.redis_client()
    batch_ids = r.zrevrange(keys.batches_of(owner), 0, batch_quota.MAX_BATCHES_COUNTED - 1)
    pipe = r.pipeline(transaction=False)
    for other in batch_ids:
        pipe.hmget(keys.batch_hash(str(other)), batch_quota.FIELDS)
    return limit - batch_quota.count_lines(pipe.execute() if batch_ids else []).num_in_flight


def _cancel_queued(job_ids: list[str]) -> int:
    """Cancel those of `job_ids` still queued -> how many were."""
    if not job_ids:
        return 0
    settings, r = runtime.settings(), runtime.redis_client()
    info = ErrorInfo(code=ErrorCode.CANCELLED, message="the batch was cancelled before this request started")
    error = info.model_dump_json(exclude_none=True)
    event = ErrorEvent(status=JobStatus.CANCELLED, error=info).model_dump_json(exclude_none=True)
    script = r.register_script(batch_lua.CANCEL_QUEUED_JOB)
    pipes = redis_urls.PartitionPipelines(r)  # a batch's jobs share its partition: one pipeline
    contexts = lua.contexts(settings.events_maxlen, settings.result_ttl_s, settings.redis_partitions)
    for job_id in job_ids:
        partition = keys.partition_of(job_id)
        script(
            keys=[keys.job_hash(job_id), keys.job_events(job_id)],
            args=[contexts[partition], job_id, error, event],
            client=pipes.of(partition),
        )
    return sum(1 for replies in pipes.execute().values() for res in replies if res == "ok")


@shared_task(name="specfleet.batches.cancel", acks_late=True)
def cancel(batch_id: str) -> int:
    """Cancel every queued line's job of a cancelling batch (running ones finish and keep their results)."""
    r = runtime.redis_client()
    num_cancelled = 0
    batch: list[str] = []
    for _, job_id in r.hscan_iter(keys.batch_jobs(batch_id), count=CANCEL_CHUNK_JOBS):
        batch.append(job_id)
        if len(batch) >= CANCEL_CHUNK_JOBS:
            num_cancelled += _cancel_queued(batch)
            batch = []
    num_cancelled += _cancel_queued(batch)
    log.info("batch %s: %d queued lines cancelled", batch_id, num_cancelled)
    if r.eval(batch_lua.READY, 1, keys.batch_hash(batch_id)) == "finalize":
        finalize.delay(batch_id)
    return num_cancelled


@shared_task(name="specfleet.batches.reconcile", acks_late=True)
def reconcile(batch_id: str) -> str:
    """The safety net while a batch runs: count lines whose job finished but whose outbox notice was lost
    (e.g. trimmed while no Celery worker ran), re-kick expansion or cancellation (both idempotent), and
    finalize when ready. Re-enqueues itself until the batch has ended."""
    from workers.tasks.outbox import OutboxHandler

    r, settings = runtime.redis_client(), runtime.settings()
    fields = runtime.hgetall(keys.batch_hash(batch_id))
    if not fields or BatchStatus(fields["status"]).is_terminal:
        return "ended"
    status = BatchStatus(fields["status"])
    settings = runtime.settings()
    handler = OutboxHandler(r, runtime.base_url(), settings.served_model_name, settings.reasoning_parser)
    num_recovered = 0
    lines_jobs: list[tuple[int, str]] = []
    for line, job_id in r.hscan_iter(keys.batch_jobs(batch_id), count=FILL_CHUNK_LINES):
        lines_jobs.append((int(line), str(job_id)))
    for start in range(0, len(lines_jobs), FILL_CHUNK_LINES):
        chunk = lines_jobs[start : start + FILL_CHUNK_LINES]
        have = r.hmget(keys.batch_results(batch_id), [str(line) for line, _ in chunk])
        for (line, job_id), result in zip(chunk, have, strict=True):
            if result is None and handler.settle_batch_line(batch_id, line, job_id):
                num_recovered += 1
    if num_recovered:
        log.warning("batch %s: %d finished lines recovered without their notice", batch_id, num_recovered)
    stalled_s = max(10 * settings.batch_retry_s, settings.batch_reconcile_interval_s)
    last_expand_s = float(fields.get("expand_ran_at") or 0)
    if (
        status is BatchStatus.IN_PROGRESS
        and fields.get("expansion") == "running"
        and time.time() - last_expand_s > stalled_s
    ):
        log.warning("batch %s: expansion stalled; restarting it", batch_id)
        expand.delay(batch_id)
    elif status is BatchStatus.CANCELLING:
        cancel.delay(batch_id)
    if r.eval(batch_lua.READY, 1, keys.batch_hash(batch_id)) == "finalize":
        finalize.delay(batch_id)
    reconcile.apply_async((batch_id,), countdown=settings.batch_reconcile_interval_s)
    return "watching"


def _fill_unstarted(batch_id: str, total: int, code: str, message: str) -> int:
    r = runtime.redis_client()
    written = 0
    for start in range(0, total, FILL_CHUNK_LINES):
        end = min(total, start + FILL_CHUNK_LINES)
        have = r.hmget(keys.batch_results(batch_id), [str(i) for i in range(start, end)])
        missing = [start + i for i, value in enumerate(have) if value is None]
        if not missing:
            continue
        raw_lines = runtime.lrange(keys.batch_lines(batch_id), start, end - 1)
        args: list[str] = []
        for index in missing:
            custom_id = (
                BatchLine.from_json(raw_lines[index - start]).custom_id
                if index - start < len(raw_lines)
                else ""
            )
            args += [str(index), _json(unstarted_line(custom_id, code, message))]
        written += int(
            r.eval(batch_lua.FILL, 2, keys.batch_hash(batch_id), keys.batch_results(batch_id), *args)
        )
    return written


def _json(value: object) -> str:
    return json.dumps(value, separators=(",", ":"))


@shared_task(name="specfleet.batches.finalize", acks_late=True)
def finalize(batch_id: str) -> str:
    """Decide the final status once every line is settled; stamp it; keep results for batch_result_ttl_s."""
    r, settings = runtime.redis_client(), runtime.settings()
    fields = runtime.hgetall(keys.batch_hash(batch_id))
    if not fields:
        return "missing"
    status = BatchStatus(fields["status"])
    if status.is_terminal:
        return status.value
    if status is BatchStatus.IN_PROGRESS:
        if _transition(batch_id, BatchStatus.FINALIZING) != "ok":
            return "raced"
    total = int(fields["total"])
    if status is BatchStatus.CANCELLING:
        _fill_unstarted(
            batch_id, total, ErrorCode.CANCELLED.value, "the batch was cancelled before this request started"
        )
    else:  # nothing should be missing; a line whose notice was lost is reported, not left out
        _fill_unstarted(batch_id, total, ErrorCode.INTERNAL.value, "the request's result was lost")
    fields = runtime.hgetall(keys.batch_hash(batch_id))
    if status is BatchStatus.CANCELLING:
        final = BatchStatus.CANCELLED
    elif int(fields.get("num_expired") or 0) > 0:
        final = BatchStatus.EXPIRED
    elif int(fields.get("completed") or 0) == 0:
        final = BatchStatus.FAILED
    else:
        final = BatchStatus.COMPLETED
    files = batch_files.batch_files(r, fields, final)  # its output and error files, in its owner's GET /v1/files
    if batch_files.end_with_files(r, files, final) != "ok":  # listed as it ends: whoever sees it ended finds them
        return "raced"
    pipe = redis_urls.pipeline(r, transaction=True, partition=keys.partition_of(batch_id))
    for key in (keys.batch_hash(batch_id), keys.batch_jobs(batch_id), keys.batch_results(batch_id)):
        pipe.expire(key, settings.batch_result_ttl_s)
    pipe.delete(keys.batch_lines(batch_id))
    pipe.execute()
    log.info(
        "batch %s %s: %s", batch_id, final.value, {k: fields.get(k) for k in ("total", "completed", "failed")}
    )
    url = fields.get("webhook")
    if url:
        body = batch_from_fields(
            runtime.hgetall(keys.batch_hash(batch_id)), runtime.base_url()
        ).model_dump_json()
        webhooks.enqueue("batch", batch_id, WebhookEvent.COMPLETED, url, f"msg_{batch_id}_completed", body)
    return final.value


# lambdas: the task proxies resolve to the app only when a notice is sent, never at import
registry.register_batch(BatchAction.EXPAND, lambda batch_id: expand.delay(batch_id))
registry.register_batch(BatchAction.CANCEL, lambda batch_id: cancel.delay(batch_id))
registry.register_batch(BatchAction.FINALIZE, lambda batch_id: finalize.delay(batch_id))
