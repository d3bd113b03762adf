"""API keys: what a key is, how it is made and stored (hashed), and its management (create, list, revoke).

A key is `sf-` + 43 url-safe characters (256 random bits). Only its SHA-256 is stored (a key is a random secret,
not a password: a fast hash is enough and makes a lookup one HGETALL); the secret is shown once, at creation.
Each key has an id (`key_<hex>`, safe to log), a name, limits (requests and tokens per rate_limit_period_s,
concurrent jobs; 0 = unlimited), an admin flag (fleet stats, every tenant's jobs) and a webhook signing secret
(`whsec_...`) for its jobs' webhooks. Revoking sets `revoked_at`: the next request with the key gets 401.

The gateway reads records with redis.asyncio (gateway/auth.py); the command line and `specfleet up` manage them
with the synchronous client here.
"""

import base64
import hashlib
import secrets
import time
from dataclasses import dataclass, fields
from typing import Any

import redis

from shared import keys
from shared import redis_url as redis_urls
from shared.webhook_signing import secret_key

KEY_PREFIX = "sf-"
WEBHOOK_SECRET_PREFIX = "whsec_"
MAX_KEY_CHARS = 200  # a longer Authorization value is refused before it is hashed
MAX_NAME_CHARS = 128  # a key's label
# KEYS[1]: a key's record; ARGV[1]: the time -> 1 when it existed and is now revoked, else 0
REVOKE_IF_EXISTS = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('HSET', KEYS[1], 'revoked_at', ARGV[1])
return 1
"""


@dataclass(frozen=True)
class ApiKey:
    """One key's record (never its secret)."""

    id: str
    name: str
    created_at: float  # unix s
    requests_per_min: int  # per settings.rate_limit_period_s; 0 = unlimited
    tokens_per_min: int
    max_concurrent_jobs: int
    is_admin: bool = False
    revoked_at: float | None = None
    webhook_secret: str = ""  # whsec_<base64>: signs the webhooks of this key's jobs and batches

    @property
    def is_active(self) -> bool:
        return self.revoked_at is None

    def to_fields(self) -> dict[str, str]:
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None:
                continue
            out[f.name] = ("1" if value else "0") if isinstance(value, bool) else str(value)
        return out

    @classmethod
    def from_fields(cls, raw: dict[str, str]) -> "ApiKey":
        return cls(
            id=raw["id"],
            name=raw.get("name", ""),
            created_at=float(raw.get("created_at") or 0),
            requests_per_min=int(raw.get("requests_per_min") or 0),
            tokens_per_min=int(raw.get("tokens_per_min") or 0),
            max_concurrent_jobs=int(raw.get("max_concurrent_jobs") or 0),
            is_admin=raw.get("is_admin") == "1",
            revoked_at=float(raw["revoked_at"]) if raw.get("revoked_at") else None,
            webhook_secret=raw.get("webhook_secret", ""),
        )

    def public(self) -> dict[str, Any]:
        """What `keys list` shows: everything but the webhook secret."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "webhook_secret"}


def new_secret() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def _check_new_key(name: str, limits: tuple[int, int, int], webhook_secret: str | None) -> None:
    """ValueError naming what is wrong: a key that would work badly is never made (a negative limit read as none;
    a secret that is not base64 failed every webhook of the key's jobs, at delivery)."""
    if not name.strip() or len(name) > MAX_NAME_CHARS:
        raise ValueError(f"a key's name is 1 to {MAX_NAME_CHARS} characters, not only spaces")
    if any(limit < 0 for limit in limits):
        raise ValueError("a limit is a count >= 0 (0: no limit)")
    if webhook_secret is not None:
        if not webhook_secret.startswith(WEBHOOK_SECRET_PREFIX):
            raise ValueError(f"a webhook secret is {WEBHOOK_SECRET_PREFIX} followed by base64")
        if not secret_key(webhook_secret):  # ValueError: not base64
            raise ValueError("a webhook secret's key is at least one byte")


def new_webhook_secret() -> str:
    return WEBHOOK_SECRET_PREFIX + base64.b64encode(secrets.token_bytes(32)).decode()


def digest(secret: str) -> str:
    """The stored form of a key: SHA-256 hex of its secret."""
    return hashlib.sha256(secret.encode("utf-8", "surrogatepass")).hexdigest()


def looks_like_key(secret: str) -> bool:
    return secret.startswith(KEY_PREFIX) and len(secret) <= MAX_KEY_CHARS and secret.isascii()


class KeyRegistry:
    """Create, list, revoke keys in Redis (synchronous client, decode_responses=True)."""

    def __init__(self, client: redis.Redis, num_partitions: int = 1) -> None:
        self.redis = client
        self.num_partitions = num_partitions  # settings.redis_partitions: a new key's tenant partition

    def create(
        self,
        name: str,
        *,
        requests_per_min: int,
        tokens_per_min: int,
        max_concurrent_jobs: int,
        is_admin: bool = False,
        webhook_secret: str | None = None,
    ) -> tuple[ApiKey, str]:
        """A new key -> (its record, its secret). The secret is not stored: show it once.

        The record goes to the tenant's partition (from the digest, where the gateway looks at auth time) and
        the key's id names that partition. The global index learns the id first, then the record is written: two
        steps (two slots on a Cluster). A crash between them leaves an index entry without a record, which the
        listing skips, revoking refuses and no request can use (its secret was never shown); the other order
        would leave a working key that the index, and so revoking by id, does not know."""
        _check_new_key(name, (requests_per_min, tokens_per_min, max_concurrent_jobs), webhook_secret)
        secret = new_secret()
        hashed = digest(secret)
        partition = keys.tenant_partition(hashed, self.num_partitions)
        key = ApiKey(
            id=keys.mark("key_" + secrets.token_hex(8), partition),
            name=name,
            created_at=time.time(),
            requests_per_min=requests_per_min,
            tokens_per_min=tokens_per_min,
            max_concurrent_jobs=max_concurrent_jobs,
            is_admin=is_admin,
            webhook_secret=webhook_secret or new_webhook_secret(),
        )
        self.redis.hset(keys.API_KEYS_INDEX, key.id, hashed)
        self.redis.hset(keys.api_key_record(hashed, partition), mapping=key.to_fields())  # type: ignore[arg-type]
        return key, secret

    def list(self) -> list[ApiKey]:
        index: dict[str, str] = self.redis.hgetall(keys.API_KEYS_INDEX)  # type: ignore[assignment]
        records = []
        for partition, entries in keys.by_partition(index.items(), lambda entry: entry[0]).items():
            pipe = redis_urls.pipeline(self.redis, transaction=False, partition=partition)
            for _, hashed in entries:
                pipe.hgetall(keys.api_key_record(hashed, partition))
            records += [ApiKey.from_fields(raw) for raw in pipe.execute() if raw]
        return sorted(records, key=lambda k: k.created_at)

    def revoke(self, key_id: str) -> bool:
        """Revoke a key by id -> False when there is no such key."""
        hashed = self.redis.hget(keys.API_KEYS_INDEX, key_id)
        if not hashed:
            return False
        record = keys.api_key_record(str(hashed), keys.partition_of(key_id))
        # HSET only where the record exists: an index entry left without one (create's first step) stays that
        # way instead of becoming a record of a lone revoked_at (one slot: the check and the write are atomic)
        return bool(self.redis.eval(REVOKE_IF_EXISTS, 1, record, str(time.time())))

    def num_active(self) -> int:
        return sum(1 for key in self.list() if key.is_active)


def key_of_digest(client: redis.Redis, hashed: str, num_partitions: int = 1) -> ApiKey | None:
    """The key whose secret has this digest (in its tenant's partition), or None."""
    raw: dict[str, str] = client.hgetall(keys.api_key_record(hashed, keys.tenant_partition(hashed, num_partitions)))  # type: ignore[assignment]
    return ApiKey.from_fields(raw) if raw else None


def webhook_secret_of(client: redis.Redis, resource_key: str) -> str | None:
    """The webhook signing secret of the key that owns a job or batch (its hash key), if it has an owner."""
    owner = client.hget(resource_key, keys.OWNER_FIELD)
    if not owner:
        return None
    hashed = client.hget(keys.API_KEYS_INDEX, str(owner))
    if not hashed:
        return None
    secret = client.hget(keys.api_key_record(str(hashed), keys.partition_of(str(owner))), "webhook_secret")
    return str(secret) if secret else None
