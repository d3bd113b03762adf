"""The job state machine: statuses and their legal transitions, in one place.

queued ──▶ running ──▶ succeeded | failed | cancelled
  │  ▲        │
  │  └────────┘  (handed back on shutdown: running -> queued; reclaimed: running -> running)
  └──▶ cancelled | expired | failed
"""

from enum import StrEnum


class JobStatus(StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    EXPIRED = "expired"

    @property
    def is_terminal(self) -> bool:
        return self in TERMINAL


TERMINAL = frozenset({JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED, JobStatus.EXPIRED})

TRANSITIONS: dict[JobStatus, frozenset[JobStatus]] = {
    JobStatus.QUEUED: frozenset(
        {JobStatus.RUNNING, JobStatus.CANCELLED, JobStatus.EXPIRED, JobStatus.FAILED}
    ),
    JobStatus.RUNNING: frozenset(
        {JobStatus.RUNNING, JobStatus.QUEUED, JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED}
    ),
    JobStatus.SUCCEEDED: frozenset(),
    JobStatus.FAILED: frozenset(),
    JobStatus.CANCELLED: frozenset(),
    JobStatus.EXPIRED: frozenset(),
}


# The one operator action outside the machine above: `specfleet dlq retry` (shared/dlq.py) puts a job that
# failed with `max_deliveries_exceeded` back in its queue, keeping its output so far (failed -> queued).
DEAD_LETTER_RETRY_FROM = frozenset({JobStatus.FAILED})


def can_transition(current: JobStatus, new: JobStatus) -> bool:
    return new in TRANSITIONS[current]


def sources_of(new: JobStatus) -> list[JobStatus]:
    """Every status from which `new` may be entered (what the atomic Lua transitions check against)."""
    return [status for status, targets in TRANSITIONS.items() if new in targets]


class ErrorCode(StrEnum):
    """`error.code` values of failed/cancelled/expired jobs and of HTTP errors."""

    INVALID_REQUEST = "invalid_request"
    PROMPT_TOO_LONG = "prompt_too_long"
    NOT_FOUND = "not_found"
    CONFLICT = "conflict"
    QUEUE_FULL = "queue_full"
    UNAVAILABLE = "unavailable"
    INTERNAL = "internal_error"
    CANCELLED = "cancelled"
    EXPIRED = "expired"
    MAX_DELIVERIES = "max_deliveries_exceeded"
    ENGINE_ERROR = "engine_error"
    TIMEOUT = "timeout"  # the job ran past its execution deadline (`timeout_s`, `Cancel-After`); output kept
    # authentication, limits and request hardening (gateway/auth.py, rate_limit.py, body_limit.py)
    UNAUTHORIZED = "unauthorized"
    FORBIDDEN = "forbidden"
    RATE_LIMITED = "rate_limit_exceeded"
    TOO_LARGE = "request_too_large"
