"""Submit-time SSRF check of a webhook URL (shared/ssrf.py): 422 when its host is not public."""

import asyncio

from gateway.errors import ApiError
from shared.job_state import ErrorCode
from shared.settings import ServiceSettings
from shared.ssrf import Allowlist, UnsafeWebhookUrl, check_url


async def check_webhook(url: str | None, settings: ServiceSettings) -> None:
    if url is None:
        return
    allow = Allowlist.parse(settings.webhook_allow_hosts)
    try:
        await asyncio.to_thread(check_url, url, allow)  # DNS resolution blocks
    except UnsafeWebhookUrl as exc:
        raise ApiError(422, ErrorCode.INVALID_REQUEST, f"webhook refused: {exc}", field="webhook") from exc
