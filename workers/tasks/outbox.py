"""The outbox bridge: notices on the outbox streams (keys.outbox_stream) -> Celery tasks and batch bookkeeping.

Runs as threads inside every Celery worker (a worker bootstep), one per partition (shared/keys.py: each has its
own outbox stream, on its own slot of a Cluster), reading its stream through consumer group keys.OUTBOX_GROUP:
several Celery workers share the notices. An entry is acked only after it was handled,
so a bridge that dies leaves its entries pending; they are re-read at restart (same consumer name) or
claimed by another bridge after PENDING_CLAIM_IDLE_MS. Handling is idempotent (webhook ids are stable,
batch lines are counted once), which makes this at-least-once without double counting.

    job start/output/completed -> webhook delivery task (if the job's webhook wants the event)
    job completed of a batch line -> its result line + count (LINE_DONE); the last one -> finalize task
    batch created -> expand task;  batch cancel -> cancel task

The tasks are reached through workers/tasks/registry.py (the task modules register there), so this module
imports no task module and no Celery app.
"""

import json
import logging
import threading
from typing import Any

import redis
from celery import bootsteps
from pydantic import ValidationError
from redis.exceptions import ResponseError

from shared import batch_lua, keys, lua, openai_compat
from shared.batch_format import BATCH_ID_KEY, BATCH_LINE_KEY, BatchLine, result_line
from shared.job_record import job_from_fields
from shared.job_state import JobStatus
from shared.outbox import BatchEvent, Notice, NoticeKind, job_actions
from shared.reasoning import ReasoningParser
from shared.schemas import Job, WebhookEvent, WebhookTarget
from workers.tasks import registry
from workers.tasks.registry import BatchAction

log = logging.getLogger(__name__)

READ_COUNT = 100
BLOCK_MS = 1000
PENDING_CLAIM_IDLE_MS = 60_000
ERROR_PAUSE_S = 1.0


class OutboxHandler:
    """What one notice does (no Celery worker needed to test it: it only enqueues tasks)."""

    def __init__(
        self,
        client: redis.Redis,
        base_url: str,
        served_model_name: str | None = None,
        reasoning_parser: ReasoningParser = "none",  # settings.reasoning_parser: chat lines' thinking apart
    ) -> None:
        self.reasoning_parser = reasoning_parser
        self.redis = client
        self.base_url = base_url
        self.served_model_name = served_model_name  # settings.served_model_name: what the gateway calls the model
        self._line_done = client.register_script(batch_lua.LINE_DONE)
        self._read_job_script = client.register_script(lua.READ_JOB)

    def handle(self, notice: Notice) -> None:
        if notice.kind is NoticeKind.BATCH:
            self._batch(notice)
        else:
            self._job(notice)

    def _read_job(self, job_id: str) -> dict[str, str]:
        """The job's record with its whole output ({} when it is gone)."""
        return lua.fields_of(self._read_job_script(keys=lua.read_job_keys(job_id)))

    def _batch(self, notice: Notice) -> None:
        if notice.event == BatchEvent.CREATED:
            registry.send_batch(BatchAction.EXPAND, notice.id)
        elif notice.event == BatchEvent.CANCEL:
            registry.send_batch(BatchAction.CANCEL, notice.id)

    def _job(self, notice: Notice) -> None:
        fields = self._read_job(notice.id)
        if not fields:
            log.debug("notice for job %s that no longer exists", notice.id)
            return
        event = WebhookEvent(notice.event)
        target = _webhook_target(notice.id, fields["request"])
        job = job_from_fields(fields, self.base_url)
        batch_id = job.metadata.get(BATCH_ID_KEY)
        actions = job_actions(event, target.webhook, target.webhook_events_filter, batch_id)
        if actions.webhook and target.webhook:
            registry.send_job_webhook(notice.id, event, notice.entry_id, target.webhook, job.model_dump_json())
        if actions.batch_line and batch_id and job.status.is_terminal:
            self._batch_line_done(batch_id, int(job.metadata[BATCH_LINE_KEY]), job)

    def settle_batch_line(self, batch_id: str, index: int, job_id: str) -> bool:
        """Count a batch line from its job if that has finished (reconcile) -> whether it had."""
        fields = self._read_job(job_id)
        if not fields:
            return False
        job = job_from_fields(fields, self.base_url)
        if not job.status.is_terminal:
            return False
        self._batch_line_done(batch_id, index, job)
        return True

    def _batch_line_done(self, batch_id: str, index: int, job: Job) -> None:
        pipe = self.redis.pipeline(transaction=False)
        pipe.lindex(keys.batch_lines(batch_id), index)
        pipe.hget(keys.batch_hash(batch_id), "model")  # the served name: the gateway's at creation, or a line's
        pipe.hget(keys.MODEL_INFO, "model")
        raw, batch_model, published = pipe.execute()
        if raw is None:  # the batch was finalized (or expired) already
            return
        model = str(batch_model or self.served_model_name or openai_compat.served_name(published or "specfleet"))
        line = result_line(BatchLine.from_json(str(raw)), job, model, self.reasoning_parser)
        outcome = "completed" if job.status is JobStatus.SUCCEEDED else "failed"
        res = self._line_done(
            keys=[keys.batch_hash(batch_id), keys.batch_results(batch_id)],
            args=[
                index,
                outcome,
                json.dumps(line, separators=(",", ":")),
                int(job.status is JobStatus.EXPIRED),
                repr(job.metrics.compute_s or 0.0),
                repr(job.metrics.cost or 0.0),
                job.usage.prompt_tokens or 0,
                job.usage.completion_tokens,
                model,
            ],
        )
        if res == "finalize":
            registry.send_batch(BatchAction.FINALIZE, batch_id)


def _webhook_target(job_id: str, raw_request: str) -> WebhookTarget:
    """The job's webhook from its stored request, its two fields alone: a request that would not validate whole
    (stored by another version, its job failed by the worker) still has its webhook called. None that validates:
    no webhook."""
    try:
        return WebhookTarget.model_validate_json(raw_request)
    except ValidationError as exc:
        log.warning("job %s: its stored webhook does not validate (%s): no webhook", job_id, exc.errors()[0]["msg"])
        return WebhookTarget()


class OutboxBridge:
    """The bridge of one partition's outbox stream."""

    def __init__(self, client: redis.Redis, handler: OutboxHandler, consumer: str, partition: int = 0) -> None:
        self.redis = client
        self.handler = handler
        self.consumer = consumer
        self.partition = partition
        self.stream = keys.outbox_stream(partition)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def ensure_group(self) -> None:
        try:  # from the start of the stream: notices written before the first Celery worker are handled
            self.redis.xgroup_create(self.stream, keys.OUTBOX_GROUP, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    def start(self) -> None:
        self._thread = threading.Thread(target=self.run, name=f"outbox-bridge-{self.partition}", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def run(self) -> None:
        reread_own = True  # first our own pending entries (a previous run of this consumer died mid-way)
        claim_every = max(1, PENDING_CLAIM_IDLE_MS // BLOCK_MS)
        rounds = 0
        while not self._stop.is_set():
            try:
                if rounds == 0:
                    self.ensure_group()
                rounds += 1
                if rounds % claim_every == 0:
                    self._claim_abandoned()
                entries = self._read("0" if reread_own else ">")
                if reread_own and not entries:
                    reread_own = False
                    continue
                self._handle(entries)
            except redis.RedisError as exc:
                log.warning("outbox bridge: %s; retrying", exc)
                reread_own = True
                rounds = 0  # the group again first: a Redis that came back empty (no persistence, a flush) lost it
                self._stop.wait(ERROR_PAUSE_S)

    def _read(self, from_id: str) -> list[tuple[str, dict[str, str]]]:
        block = None if from_id == "0" else BLOCK_MS
        res = self.redis.xreadgroup(
            keys.OUTBOX_GROUP, self.consumer, {self.stream: from_id}, count=READ_COUNT, block=block
        )
        return list(res[0][1]) if res else []  # type: ignore[index,arg-type]

    def _claim_abandoned(self) -> None:
        _, claimed, *_ = self.redis.xautoclaim(  # type: ignore[misc]
            self.stream,
            keys.OUTBOX_GROUP,
            self.consumer,
            PENDING_CLAIM_IDLE_MS,
            "0-0",
            count=READ_COUNT,
        )
        self._handle([(entry_id, fields) for entry_id, fields in claimed if fields])

    def _handle(self, entries: list[tuple[str, dict[str, str]]]) -> None:
        for entry_id, fields in entries:
            if not fields:  # trimmed away while pending
                self.redis.xack(self.stream, keys.OUTBOX_GROUP, entry_id)
                continue
            try:
                self.handler.handle(Notice.from_entry(entry_id, fields))
            except redis.RedisError:
                raise  # left pending; re-read after the pause
            except Exception:  # a notice that cannot be handled must not block the ones after it
                log.exception("outbox notice %s %s could not be handled; dropped", entry_id, fields)
            self.redis.xack(self.stream, keys.OUTBOX_GROUP, entry_id)


class OutboxStep(bootsteps.StartStopStep):
    """Runs the bridges (one per partition) inside the Celery worker process, started and stopped with it."""

    def __init__(self, parent: Any, **kwargs: Any) -> None:
        super().__init__(parent, **kwargs)
        self.bridges: list[OutboxBridge] = []

    def start(self, parent: Any) -> None:
        from workers.tasks import runtime

        parent.app.loader.import_default_modules()  # the app's task modules, which fill the registry
        client = runtime.redis_client()
        settings = runtime.settings()
        handler = OutboxHandler(client, runtime.base_url(), settings.served_model_name, settings.reasoning_parser)
        for partition in range(runtime.settings().redis_partitions):
            bridge = OutboxBridge(client, handler, str(parent.hostname), partition)
            bridge.start()
            self.bridges.append(bridge)
        log.info("outbox bridges of %d partitions started as %s", len(self.bridges), parent.hostname)

    def stop(self, parent: Any) -> None:
        for bridge in self.bridges:
            bridge.stop()
        self.bridges = []
