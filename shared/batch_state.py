"""The batch state machine (OpenAI Batch's lifecycle): statuses and their legal transitions, in one place.

validating ──▶ in_progress ──▶ finalizing ──▶ completed | failed | expired
     │              │
     └──────────────┴──▶ cancelling ──▶ cancelled

`validating`: accepted and stored, its lines not yet submitted; `in_progress`: lines are jobs at `batch`
priority; `finalizing`: every line has finished, the final status is being decided; `completed` (some line
succeeded), `failed` (no line succeeded), `expired` (some line was not started within the completion
window). `cancelling`: queued lines are being cancelled, running ones finish; then `cancelled`.
Each status entered stamps `<status>_at` on the batch.
"""

from enum import StrEnum


class BatchStatus(StrEnum):
    VALIDATING = "validating"
    IN_PROGRESS = "in_progress"
    FINALIZING = "finalizing"
    COMPLETED = "completed"
    FAILED = "failed"
    EXPIRED = "expired"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"

    @property
    def is_terminal(self) -> bool:
        return not TRANSITIONS[self]

    @property
    def timestamp_field(self) -> str:
        """The batch field stamped when this status is entered (`validating` is `created_at`)."""
        return "created_at" if self is BatchStatus.VALIDATING else f"{self.value}_at"


TRANSITIONS: dict[BatchStatus, frozenset[BatchStatus]] = {
    BatchStatus.VALIDATING: frozenset({BatchStatus.IN_PROGRESS, BatchStatus.CANCELLING}),
    BatchStatus.IN_PROGRESS: frozenset({BatchStatus.FINALIZING, BatchStatus.CANCELLING}),
    BatchStatus.FINALIZING: frozenset({BatchStatus.COMPLETED, BatchStatus.FAILED, BatchStatus.EXPIRED}),
    BatchStatus.CANCELLING: frozenset({BatchStatus.CANCELLED}),
    BatchStatus.COMPLETED: frozenset(),
    BatchStatus.FAILED: frozenset(),
    BatchStatus.EXPIRED: frozenset(),
    BatchStatus.CANCELLED: frozenset(),
}


def can_transition(current: BatchStatus, new: BatchStatus) -> bool:
    return new in TRANSITIONS[current]


def sources_of(new: BatchStatus) -> list[BatchStatus]:
    return [status for status, targets in TRANSITIONS.items() if new in targets]
