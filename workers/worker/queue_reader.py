"""Taking jobs off the queue streams: highest priority first, anti-starvation, only as many as fit.

One PULL script call (shared/lua.py) reclaims entries of dead workers (XAUTOCLAIM, every
`reclaim_interval_s`), then reads the streams one at a time in priority order (a multi-stream XREADGROUP
would not honour priority) and starts each job atomically. When nothing is waiting, the worker blocks on a
plain XREAD of every stream after the last ids the script saw, so no job that arrives meanwhile is missed.
"""

import time
from dataclasses import dataclass, field
from typing import Any

import redis
from redis.exceptions import ResponseError

from shared import keys, lua
from shared.job_record import parse_token_ids
from shared.job_state import ErrorCode, JobStatus
from shared.schemas import ErrorEvent, ErrorInfo, JobRequest, Priority
from shared.settings import ServiceSettings
from workers.worker.deadlines import JobClock


@dataclass
class Lease:
    """A job this worker holds: its queue entry, its current attempt, and output of earlier attempts."""

    job_id: str
    entry_id: str
    priority: Priority
    attempt: int
    request: JobRequest
    resumed_text: str = ""  # produced by earlier attempts (this one continues after it)
    resumed_token_ids: list[int] = field(default_factory=list)
    clock: JobClock | None = None  # created / first started / retried (unix s): the execution deadline's base


class PriorityOrder:
    """Highest priority first, except that a priority passed over `starvation_limit` times while it had
    waiting jobs is read first next time (its count then restarts)."""

    def __init__(self, starvation_limit: int) -> None:
        self.starvation_limit = starvation_limit
        self.num_passed_over = {p: 0 for p in Priority}

    def order(self) -> list[Priority]:
        starved = [p for p in Priority if self.num_passed_over[p] >= self.starvation_limit]
        return starved + [p for p in Priority if p not in starved]

    def record(self, taken: list[Priority], waiting: dict[Priority, bool]) -> None:
        """After a pull: which priorities gave jobs, and which still have jobs waiting."""
        for priority in Priority:
            if priority in taken:
                self.num_passed_over[priority] = 0
            elif taken and waiting[priority]:
                self.num_passed_over[priority] += len(taken)


def _error_json(status: JobStatus, code: ErrorCode, message: str) -> tuple[str, str]:
    info = ErrorInfo(code=code, message=message)
    return info.model_dump_json(exclude_none=True), ErrorEvent(status=status, error=info).model_dump_json(
        exclude_none=True
    )


class QueueReader:
    def __init__(self, client: redis.Redis, settings: ServiceSettings, consumer: str) -> None:
        self.redis = client
        self.settings = settings
        self.consumer = consumer
        self.priority_order = PriorityOrder(settings.starvation_limit)
        self._pull = client.register_script(lua.PULL)
        self._requeue = client.register_script(lua.REQUEUE)
        self._ctx = lua.context(settings.events_maxlen, settings.result_ttl_s)
        self._expired = _error_json(
            JobStatus.EXPIRED, ErrorCode.EXPIRED, "the job's ttl_s passed before it started"
        )
        self._dead = _error_json(
            JobStatus.FAILED,
            ErrorCode.MAX_DELIVERIES,
            f"the job was started {settings.max_deliveries} times and its worker died each time",
        )
        self._last_reclaim_s = -float("inf")
        self.last_ids = {p: "0-0" for p in Priority}  # newest entry seen per stream by the last pull
        self.waiting = {p: False for p in Priority}  # undelivered entries left after the last pull

    def ensure_groups(self) -> None:
        for priority in Priority:
            try:
                self.redis.xgroup_create(
                    keys.queue_stream(priority), keys.CONSUMER_GROUP, id="0", mkstream=True
                )
            except ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise

    def pull(self, max_jobs: int, priorities: list[Priority] | None = None) -> list[Lease]:
        """Start and return up to `max_jobs` jobs (expired, cancelled and dead ones are settled on the way),
        from the queues of `priorities` only when given (a full engine that would preempt for them); such a
        pull reclaims nothing, and leaves the other queues' `waiting` as the last full pull saw them."""
        if max_jobs <= 0:
            return []
        reclaim_ms = "0"
        if priorities is None and time.monotonic() - self._last_reclaim_s >= self.settings.reclaim_interval_s:
            self._last_reclaim_s = time.monotonic()
            reclaim_ms = str(int(self.settings.claim_timeout_s * 1000))
        order = [p for p in self.priority_order.order() if priorities is None or p in priorities]
        call_keys = [keys.queue_stream(p) for p in order]
        call_args: list[str | int] = [
            self._ctx,
            self.consumer,
            max_jobs,
            reclaim_ms,
            self.settings.max_deliveries,
            *self._expired,
            *self._dead,
            keys.DEAD_LETTER_STREAM,
            keys.DEAD_LETTER_MAXLEN,
            self.settings.model_version,
        ]
        try:
            started, waiting, last_ids = self._pull(keys=call_keys, args=call_args)
        except ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            self.ensure_groups()  # the streams were deleted under us (a flushed or replaced Redis)
            started, waiting, last_ids = self._pull(keys=call_keys, args=call_args)
        self.last_ids.update(zip(order, last_ids, strict=True))
        leases = [self._lease(order, row) for row in started]
        self.waiting.update({p: bool(w) for p, w in zip(order, waiting, strict=True)})
        self.priority_order.record([lease.priority for lease in leases], self.waiting)
        return leases

    @staticmethod
    def _lease(order: list[Priority], row: list[Any]) -> Lease:
        job_id, entry_id, stream_index, attempt, request, text, token_ids, *times = row
        return Lease(
            job_id=job_id,
            entry_id=entry_id,
            priority=order[int(stream_index) - 1],
            attempt=int(attempt),
            request=JobRequest.model_validate_json(request),
            resumed_text=text,
            resumed_token_ids=parse_token_ids(token_ids),
            clock=JobClock.of(*times),
        )

    def wait_for_jobs(self, block_ms: int) -> None:
        """Block until an entry newer than the last seen one lands on any queue stream, or block_ms pass."""
        streams = {keys.queue_stream(p): self.last_ids[p] for p in Priority}
        self.redis.xread(streams, count=1, block=block_ms)  # type: ignore[arg-type]

    def hand_back(self, lease: Lease) -> str:
        """Put a held job back at the tail of its queue (not counted as a delivery) -> 'ok' | 'gone' | 'lost'."""
        result = self._requeue(
            keys=[
                keys.job_hash(lease.job_id),
                keys.job_events(lease.job_id),
                keys.queue_stream(lease.priority),
            ],
            args=[self._ctx, lease.job_id, lease.attempt],
        )
        return str(result)
