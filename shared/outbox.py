"""Notices from the fleet to the Celery side, appended to the outbox stream of their partition (keys.outbox_stream).

    kind=job    event=start|output        (the worker, only for jobs whose webhook wants the event)
    kind=job    event=completed status=S  (the job protocol's finish(), for every job: shared/lua.py)
    kind=batch  event=created|cancel      (the gateway)

workers/tasks/outbox.py reads them (consumer group keys.OUTBOX_GROUP) and acts on them.
"""

from dataclasses import dataclass
from enum import StrEnum

from shared import keys


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


def notice_fields(kind: NoticeKind, object_id: str, event: str) -> dict[str, str]:
    """The fields of an XADD to an outbox stream (with MAXLEN ~ keys.OUTBOX_MAXLEN)."""
    return {"kind": kind.value, "id": object_id, "event": event}


def outbox_xadd(partition: int) -> dict[str, object]:
    """The stream and cap of an XADD to the outbox of `partition` (the one of the job or batch it is about)."""
    return {"name": keys.outbox_stream(partition), "maxlen": keys.OUTBOX_MAXLEN, "approximate": True}
