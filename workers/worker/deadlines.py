"""Execution deadlines: when each held job must be done, and which are past it now.

A job's deadline (unix seconds, the Redis clock the job hash's times come from):
- with `timeout_s` (the job API's field, OpenAI's extension field or the `Cancel-After` header): counted from
  the job's creation, as Replicate counts `Cancel-After`: queue time included, so a caller's "answer within
  15 s" holds end to end;
- without: `settings.job_timeout_s` of execution, counted from the job's first start. A default counted from
  creation would fail a deep batch queue wholesale; waiting is what `ttl_s` (-> `expired`) bounds.
A `specfleet dlq retry` starts both clocks again (`retried_at`). A job pulled already past its deadline (it was
handed back or reclaimed, or waited in the queue past its `timeout_s`) fails `timeout` without an engine step;
one running past it is stopped within one engine step. Either way its output so far stays in the job record.
"""

import time
from dataclasses import dataclass

from shared.schemas import JobRequest


def _unix_s(value: str | None) -> float | None:
    return float(value) if value else None


@dataclass(frozen=True)
class JobClock:
    """The job hash's times that a deadline counts from (unix seconds)."""

    created_at: float
    started_at: float  # first start (an attempt that resumes keeps the first one)
    retried_at: float | None = None  # the last `specfleet dlq retry`

    @classmethod
    def of(cls, created_at: str | None, started_at: str | None, retried_at: str | None = None) -> "JobClock":
        now_s = time.time()
        return cls(
            created_at=_unix_s(created_at) or now_s,
            started_at=_unix_s(started_at) or now_s,
            retried_at=_unix_s(retried_at),
        )

    def deadline_s(self, request: JobRequest, default_timeout_s: float) -> float:
        """Unix time by which the job must be finished."""
        if request.timeout_s is not None:
            base, timeout_s = self.created_at, request.timeout_s
        else:
            base, timeout_s = self.started_at, default_timeout_s
        return max(base, self.retried_at or 0.0) + timeout_s


class Deadlines:
    """job id -> deadline (unix s) of every job this worker holds."""

    def __init__(self, default_timeout_s: float) -> None:
        self.default_timeout_s = default_timeout_s
        self.deadline_s: dict[str, float] = {}

    def track(self, job_id: str, request: JobRequest, clock: JobClock | None) -> float:
        """Remember the job's deadline -> seconds left (<= 0: already past it)."""
        now_s = time.time()
        deadline = (clock or JobClock(now_s, now_s)).deadline_s(request, self.default_timeout_s)
        self.deadline_s[job_id] = deadline
        return deadline - now_s

    def past(self) -> list[str]:
        """Held jobs whose deadline has passed (they stay tracked until `forget`)."""
        now_s = time.time()
        return [job_id for job_id, deadline in self.deadline_s.items() if deadline <= now_s]

    def forget(self, job_ids: list[str]) -> None:
        for job_id in job_ids:
            self.deadline_s.pop(job_id, None)
