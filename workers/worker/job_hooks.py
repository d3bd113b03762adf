"""What the worker tells the Celery side while a job runs: `start` and throttled `output` webhook notices.

Only jobs whose request has a webhook wanting the event produce a notice (one XADD to the outbox); the
`completed` notice needs no hook: the job protocol's finish() writes it atomically (shared/lua.py).
`output` is throttled per job: at most one per settings.webhook_output_interval_ms (the first output of a
job goes at once; output in a step that also finishes the job is left to `completed`).
"""

import logging
import time

import redis

from shared import keys
from shared import redis_url as redis_urls
from shared.outbox import NoticeKind, notice_fields, outbox_xadd
from shared.schemas import JobRequest, WebhookEvent
from shared.settings import ServiceSettings
from workers.engine.outputs import StepOutput

log = logging.getLogger(__name__)

Notice = tuple[str, WebhookEvent]  # (job id, webhook event)


class JobHooks:
    def __init__(self, client: redis.Redis, settings: ServiceSettings) -> None:
        self.redis = client
        self.output_interval_s = settings.webhook_output_interval_ms / 1000.0
        self._wants_output: set[str] = set()  # job ids whose webhook wants `output`
        self._last_output_s: dict[str, float] = {}  # job id -> monotonic time of its last `output` notice

    def started(self, job_id: str, request: JobRequest) -> None:
        """A job started running (every attempt: a resumed job's receiver dedupes on webhook-id)."""
        self._notify(self.on_start(job_id, request))

    def emitted(self, outputs: list[StepOutput]) -> None:
        """After one engine step's output was written: an `output` notice for each due job."""
        self._notify(self.on_output(outputs))

    # -- the notices, as values (the worker's writer sends them in the step's round trip) -------------------
    def on_start(self, job_id: str, request: JobRequest) -> list[Notice]:
        if request.webhook is None:
            return []
        if WebhookEvent.OUTPUT in request.webhook_events_filter:
            self._wants_output.add(job_id)
        if WebhookEvent.START in request.webhook_events_filter:
            return [(job_id, WebhookEvent.START)]
        return []

    def on_output(self, outputs: list[StepOutput]) -> list[Notice]:
        if not self._wants_output:
            return []
        now = time.monotonic()
        due = []
        for out in outputs:
            job_id = out.request_id
            if job_id not in self._wants_output or not out.new_token_ids or out.finished:
                continue
            if now - self._last_output_s.get(job_id, -float("inf")) >= self.output_interval_s:
                self._last_output_s[job_id] = now
                due.append((job_id, WebhookEvent.OUTPUT))
        return due

    @staticmethod
    def queue(pipe: redis.client.Pipeline, notices: list[Notice]) -> None:
        """XADD each notice to the outbox of its job's partition (on a Cluster: `pipe` must be that partition's)."""
        for job_id, event in notices:
            xadd = outbox_xadd(keys.partition_of(job_id))
            pipe.xadd(fields=notice_fields(NoticeKind.JOB, job_id, event.value), **xadd)  # type: ignore[arg-type]

    def forget(self, job_ids: list[str]) -> None:
        for job_id in job_ids:
            self._wants_output.discard(job_id)
            self._last_output_s.pop(job_id, None)

    def _notify(self, notices: list[Notice]) -> None:
        if not notices:
            return
        try:
            pipes = redis_urls.PartitionPipelines(self.redis)
            for notice in notices:
                self.queue(pipes.of(keys.partition_of(notice[0])), [notice])
            pipes.execute()
        except redis.RedisError as exc:  # a lost start/output notice never stops the job
            log.warning("webhook notices for %d jobs not written: %s", len(notices), exc)
