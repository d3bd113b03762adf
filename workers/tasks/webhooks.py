"""Webhook delivery as a Celery task: signed, retried with backoff, the outcome recorded on its job/batch.

The body and webhook-id are fixed when the event is enqueued (workers/tasks/outbox.py), so every retry
sends the same message; each attempt gets a fresh webhook-timestamp and signature (Standard Webhooks).
A delivery's outcome goes to `webhook_status[event]` of its job or batch; it never changes their status.
The task is a shared task (bound to the app that includes this module: workers/tasks/celery_app.py), so
importing this module neither reads settings nor builds the app.
"""

import json
import logging
import time
from typing import Literal

from celery import Task, shared_task

from shared import api_keys, batch_lua, keys
from shared.schemas import WebhookDelivery, WebhookEvent
from shared.webhook_status import webhook_field
from workers.tasks import delivery, metrics, registry, runtime

log = logging.getLogger(__name__)

Target = Literal["job", "batch"]


def _target_key(target: Target, target_id: str) -> str:
    return keys.job_hash(target_id) if target == "job" else keys.batch_hash(target_id)


def job_message_id(job_id: str, event: WebhookEvent, notice_id: str) -> str:
    """Stable across retries; one per job for start/completed (a re-sent start dedupes), per notice for output."""
    if event is WebhookEvent.OUTPUT:
        return f"msg_{job_id}_output_{notice_id.replace('-', '_')}"
    return f"msg_{job_id}_{event.value}"


@shared_task(name="specfleet.webhooks.deliver", bind=True, acks_late=True, max_retries=None)
def deliver(self: Task, target: Target, target_id: str, event: str, url: str, msg_id: str, body: str) -> str:
    settings = runtime.settings()
    attempt_no = int(self.request.retries) + 1
    # signed with the owning API key's webhook secret (`specfleet keys create`), else the service's
    owner_secret = api_keys.webhook_secret_of(runtime.redis_client(), _target_key(target, target_id))
    result = delivery.attempt(
        url,
        msg_id,
        body.encode(),
        owner_secret or settings.webhook_secret.get_secret_value(),
        runtime.allowlist(),
        settings.webhook_timeout_s,
        event,
    )
    if result.outcome == "retry" and attempt_no < settings.webhook_max_attempts:
        countdown = delivery.backoff_s(
            attempt_no, settings.webhook_retry_base_s, settings.webhook_retry_max_s, result.retry_after_s
        )
        log.info(
            "webhook %s %s attempt %d: %s; retrying in %.2fs",
            msg_id,
            url,
            attempt_no,
            result.message,
            countdown,
        )
        metrics.WEBHOOK_RETRIES.inc()
        raise self.retry(countdown=countdown, max_retries=None)
    state: Literal["delivered", "failed", "gone"] = "failed" if result.outcome == "retry" else result.outcome
    outcome = WebhookDelivery(
        state=state,
        attempts=attempt_no,
        status_code=result.status_code,
        message=result.message,
        at=time.time(),
    )
    metrics.WEBHOOK_DELIVERIES.labels(state).inc()
    if state == "delivered":
        log.info("webhook %s delivered (attempt %d)", msg_id, attempt_no)
    else:
        log.warning("webhook %s %s after %d attempts: %s", msg_id, state, attempt_no, result.message)
    runtime.redis_client().eval(
        batch_lua.RECORD_IF_EXISTS,
        1,
        _target_key(target, target_id),
        webhook_field(WebhookEvent(event)),
        outcome.model_dump_json(exclude_none=True),
    )
    return state


def enqueue(
    target: Target, target_id: str, event: WebhookEvent, url: str, msg_id: str, body: dict | str
) -> None:
    payload = body if isinstance(body, str) else json.dumps(body, separators=(",", ":"))
    deliver.apply_async(args=[target, target_id, event.value, url, msg_id, payload])


def _send_job_webhook(job_id: str, event: WebhookEvent, entry_id: str, url: str, body: str) -> None:
    enqueue("job", job_id, event, url, job_message_id(job_id, event, entry_id), body)


registry.register_job_webhook(_send_job_webhook)
