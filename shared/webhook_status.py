"""`webhook_status` of a job or batch: one hash field per event (keys.WEBHOOK_FIELD_PREFIX + event)."""

from pydantic import ValidationError

from shared import keys
from shared.schemas import WebhookDelivery, WebhookEvent


def webhook_field(event: WebhookEvent) -> str:
    return keys.WEBHOOK_FIELD_PREFIX + event.value


def webhook_status_from(fields: dict[str, str]) -> dict[WebhookEvent, WebhookDelivery] | None:
    status = {}
    for event in WebhookEvent:
        raw = fields.get(webhook_field(event))
        if raw:
            try:
                status[event] = WebhookDelivery.model_validate_json(raw)
            except ValidationError:
                continue
    return status or None
