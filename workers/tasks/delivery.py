"""One webhook delivery attempt over HTTP, and the retry schedule: plain functions (no Celery).

An attempt re-checks the URL against the SSRF guard and connects to the address it checked (the Host
header and TLS SNI/certificate check still use the URL's host name), never follows a redirect, and sorts
the answer: 2xx delivered; 410 gone (stop); 408, 429, 5xx, timeouts and connection errors retry (honouring
Retry-After); anything else failed (no retry: the receiver will not change its mind).
"""

import email.utils
import ipaddress
import random
import time
from dataclasses import dataclass
from typing import Literal
from urllib.parse import urlsplit, urlunsplit

import httpx

from shared.ssrf import Allowlist, Target, UnsafeWebhookUrl, check_url
from shared.webhook_signing import signed_headers

Outcome = Literal["delivered", "retry", "failed", "gone"]
RETRY_STATUS = frozenset({408, 429})
USER_AGENT = "specfleet-webhooks/0.1"


@dataclass(frozen=True)
class AttemptResult:
    outcome: Outcome
    status_code: int | None = None
    message: str | None = None
    retry_after_s: float | None = None  # the receiver's Retry-After, in seconds


def parse_retry_after(value: str | None, now_s: float | None = None) -> float | None:
    """Retry-After as seconds: delta-seconds or an HTTP date; None when absent or unreadable."""
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - (time.time() if now_s is None else now_s))


def backoff_s(
    attempt: int,
    base_s: float,
    max_s: float,
    retry_after_s: float | None = None,
    rng: random.Random | None = None,
) -> float:
    """Delay before attempt `attempt + 1`: base * 2^(attempt-1) capped at max_s, with equal jitter
    (half fixed, half random), and never sooner than Retry-After (itself capped at max_s)."""
    ceiling = min(max_s, base_s * 2 ** (attempt - 1))
    delay = ceiling / 2 + (rng or random).uniform(0, ceiling / 2)
    if retry_after_s is not None:
        delay = max(delay, min(retry_after_s, max_s))
    return delay


def pinned(target: Target) -> tuple[str, dict[str, str], dict[str, str]]:
    """(URL with the checked address as host, Host header, httpx extensions) for connecting to `target`."""
    parts = urlsplit(target.url)
    address = (
        f"[{target.address}]" if isinstance(target.address, ipaddress.IPv6Address) else str(target.address)
    )
    default_port = 443 if target.scheme == "https" else 80
    netloc = f"{address}:{target.port}"
    host_header = target.host if target.port == default_port else f"{target.host}:{target.port}"
    if ":" in target.host:  # an IPv6 literal host
        host_header = f"[{target.host}]" if target.port == default_port else f"[{target.host}]:{target.port}"
    url = urlunsplit((parts.scheme, netloc, parts.path or "/", parts.query, ""))
    extensions = {"sni_hostname": target.host} if target.scheme == "https" else {}
    return url, {"Host": host_header}, extensions


def attempt(
    url: str, msg_id: str, body: bytes, secret: str, allow: Allowlist, timeout_s: float, event: str
) -> AttemptResult:
    """POST the signed body once."""
    try:
        target = check_url(url, allow)
    except UnsafeWebhookUrl as exc:
        return AttemptResult("failed", message=f"refused: {exc}")
    pinned_url, host_header, extensions = pinned(target)
    headers = {
        **host_header,
        **signed_headers(secret, msg_id, int(time.time()), body),
        "content-type": "application/json",
        "user-agent": USER_AGENT,
        "specfleet-event": event,
    }
    try:
        with httpx.Client(timeout=timeout_s, follow_redirects=False, trust_env=False) as client:
            response = client.post(pinned_url, content=body, headers=headers, extensions=extensions)
    except httpx.TimeoutException as exc:
        return AttemptResult("retry", message=f"timed out after {timeout_s:g}s: {type(exc).__name__}")
    except httpx.TransportError as exc:
        return AttemptResult("retry", message=f"connection error: {type(exc).__name__}: {exc}")
    code = response.status_code
    if 200 <= code < 300:
        return AttemptResult("delivered", code)
    if code == 410:
        return AttemptResult("gone", code, "the receiver answered 410 Gone: no more deliveries")
    if code in RETRY_STATUS or code >= 500:
        retry_after = parse_retry_after(response.headers.get("retry-after"))
        return AttemptResult("retry", code, f"HTTP {code}", retry_after)
    reason = "a redirect (not followed)" if 300 <= code < 400 else f"HTTP {code}"
    return AttemptResult("failed", code, reason)
