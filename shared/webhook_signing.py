"""Standard Webhooks signatures (https://www.standardwebhooks.com): sign what we send, verify in tests/clients.

    webhook-id:        msg_...            the same on every retry of one event (receivers dedupe on it)
    webhook-timestamp: unix seconds       of this attempt (receivers refuse stale ones: replay guard)
    webhook-signature: v1,<base64>        HMAC-SHA256 of "{id}.{timestamp}.{body}" under the secret's bytes

A secret is `whsec_` + base64 of its key bytes; several signatures may be sent space-separated (rotation).
"""

import base64
import hashlib
import hmac
import time
from collections.abc import Mapping

SECRET_PREFIX = "whsec_"
# The dev default (`env: dev` only; settings refuse it otherwise). Not a secret: it is in the source.
DEV_WEBHOOK_SECRET = "whsec_c3BlY2ZsZWV0LWRldi13ZWJob29rLXNlY3JldA=="
DEFAULT_TOLERANCE_S = 300


class InvalidSignature(ValueError):
    pass


def secret_key(secret: str) -> bytes:
    """The HMAC key of a `whsec_<base64>` secret."""
    try:
        return base64.b64decode(secret.removeprefix(SECRET_PREFIX), validate=True)
    except ValueError as exc:
        raise ValueError("a webhook secret is whsec_ followed by base64") from exc


def sign(secret: str, msg_id: str, timestamp_s: int, body: bytes) -> str:
    """The `webhook-signature` value: `v1,<base64 HMAC-SHA256 of "{id}.{timestamp}.{body}">`."""
    signed = f"{msg_id}.{timestamp_s}.".encode() + body
    digest = hmac.new(secret_key(secret), signed, hashlib.sha256).digest()
    return "v1," + base64.b64encode(digest).decode()


def signed_headers(secret: str, msg_id: str, timestamp_s: int, body: bytes) -> dict[str, str]:
    return {
        "webhook-id": msg_id,
        "webhook-timestamp": str(timestamp_s),
        "webhook-signature": sign(secret, msg_id, timestamp_s, body),
    }


def verify(
    secret: str,
    headers: Mapping[str, str],
    body: bytes,
    *,
    now_s: float | None = None,
    tolerance_s: float = DEFAULT_TOLERANCE_S,
) -> None:
    """Raise InvalidSignature unless one `v1` signature matches and the timestamp is within tolerance."""
    lower = {k.lower(): v for k, v in headers.items()}
    try:
        msg_id, timestamp = lower["webhook-id"], int(lower["webhook-timestamp"])
        candidates = lower["webhook-signature"].split()
    except (KeyError, ValueError) as exc:
        raise InvalidSignature("missing or malformed webhook-* headers") from exc
    now_s = time.time() if now_s is None else now_s
    if abs(now_s - timestamp) > tolerance_s:
        raise InvalidSignature("the webhook-timestamp is outside the tolerance")
    expected = sign(secret, msg_id, timestamp, body)
    if not any(hmac.compare_digest(expected, candidate) for candidate in candidates):
        raise InvalidSignature("no signature matches")
