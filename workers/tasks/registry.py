"""What the outbox bridge dispatches to: each task module registers its senders here when imported.

    workers/tasks/batches.py   -> BATCH_EXPAND, BATCH_CANCEL, BATCH_FINALIZE (one batch id each)
    workers/tasks/webhooks.py  -> the job webhook sender

The bridge (workers/tasks/outbox.py) only looks names up here, so it imports no task module, and the Celery
app (workers/tasks/celery_app.py) includes the task modules by name: no import cycle. This module imports
neither Celery nor settings.
"""

from collections.abc import Callable
from enum import StrEnum

from shared.schemas import WebhookEvent


class BatchAction(StrEnum):
    EXPAND = "expand"  # a batch was created: turn its lines into jobs
    CANCEL = "cancel"  # a batch is cancelling: cancel its queued lines
    FINALIZE = "finalize"  # every line settled: decide the final status


BatchSender = Callable[[str], object]  # batch id -> (enqueues a task)
# (job id, event, outbox entry id, webhook url, job body JSON) -> (enqueues a delivery)
JobWebhookSender = Callable[[str, WebhookEvent, str, str, str], object]

_batch_senders: dict[BatchAction, BatchSender] = {}
_job_webhook_senders: list[JobWebhookSender] = []


class NotRegistered(LookupError):
    """No task module registered a sender for this: the Celery app did not include it."""


def register_batch(action: BatchAction, send: BatchSender) -> None:
    _batch_senders[action] = send


def register_job_webhook(send: JobWebhookSender) -> None:
    _job_webhook_senders[:] = [send]


def send_batch(action: BatchAction, batch_id: str) -> None:
    try:
        send = _batch_senders[action]
    except KeyError:
        raise NotRegistered(f"no task registered for batch {action.value} (workers.tasks.batches)") from None
    send(batch_id)


def send_job_webhook(job_id: str, event: WebhookEvent, entry_id: str, url: str, body: str) -> None:
    if not _job_webhook_senders:
        raise NotRegistered("no job webhook sender registered (workers.tasks.webhooks)")
    _job_webhook_senders[0](job_id, event, entry_id, url, body)
