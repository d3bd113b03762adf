"""Notices from the fleet to the Celery side, appended to the outbox stream of their partition (keys.outbox_stream).

    kind=job    event=start|output        (the worker, only for jobs whose webhook wants the event)
    kind=job    event=completed status=S  (the job protocol's finish(), for jobs whose end the Celery side acts
                                          on: job_actions, asked at submit; shared/lua.py)
    kind=batch  event=created|cancel      (the gateway)

workers/tasks/outbox.py reads them (consumer group keys.OUTBOX_GROUP) and acts on them.
"""

from collections.abc import Collection
from dataclasses import dataclass
from enum import StrEnum

from shared import keys
from shared.schemas import WebhookEvent


class NoticeKind(StrEnum):
    JOB = "job"
    BATCH = "batch"


class BatchEvent(StrEnum):
    CREATED = "created"
    CANCEL = "cancel"


@dataclass(frozen=True)
class Notice:
    entry_id: str
    kind: NoticeKind
    id: str
    event: str
    status: str | None = None

    @classmethod
    def from_entry(cls, entry_id: str, fields: dict[str, str]) -> "Notice":
        return cls(entry_id, NoticeKind(fields["kind"]), fields["id"], fields["event"], fields.get("status"))


@dataclass(frozen=True)
class JobActions:
    """What the Celery side does on a job's notice."""

    webhook: bool  # call the job's webhook with the event
    batch_line: bool  # count the job's batch line (once the job is terminal)

    @property
    def any(self) -> bool:
        return self.webhook or self.batch_line


def job_actions(
    event: WebhookEvent, webhook: object | None, events_filter: Collection[WebhookEvent], batch_id: str | None
) -> JobActions:
    """The one rule for both sides: the bridge (workers/tasks/outbox.py) acts on a notice by it, and a submit
    asks it of `completed` whether the job's end writes a notice at all (shared/submit.py): a job it gives nothing
    to do ends without one (the bridge would read its whole record to find that: ~1 ms of CPU on the I/O core).
    `batch_id`: the job's metadata under shared.batch_format.BATCH_ID_KEY (the caller reads it: that module and
    its OpenAI formats stay out of every process that writes notices, the worker's among them)."""
    return JobActions(
        webhook=webhook is not None and event in events_filter,
        batch_line=event is WebhookEvent.COMPLETED and bool(batch_id),
    )


def notice_fields(kind: NoticeKind, object_id: str, event: str) -> dict[str, str]:
    """The fields of an XADD to an outbox stream (with MAXLEN ~ keys.OUTBOX_MAXLEN)."""
    return {"kind": kind.value, "id": object_id, "event": event}


def outbox_xadd(partition: int) -> dict[str, object]:
    """The stream and cap of an XADD to the outbox of `partition` (the one of the job or batch it is about)."""
    return {"name": keys.outbox_stream(partition), "maxlen": keys.OUTBOX_MAXLEN, "approximate": True}
