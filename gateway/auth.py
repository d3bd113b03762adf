"""Who is calling: `Authorization: Bearer <key>` -> the key's record (one HGETALL of its SHA-256, no cache, so a
revoked key is refused on its next request), and which jobs and batches that key may touch.

A key sees only what it created: another tenant's job or batch id answers 404, exactly as an unknown id does
(a 403 would confirm that the id exists). An admin key sees every job and batch, and the fleet's stats.
The secret never reaches a log line: only the key id does.
"""

import logging

from fastapi import Request
from fastapi.security.utils import get_authorization_scheme_param
from redis.asyncio import Redis

from gateway.errors import ApiError
from shared import api_keys, keys
from shared.api_keys import ApiKey
from shared.job_state import ErrorCode

log = logging.getLogger(__name__)

BEARER_HEADERS = {"WWW-Authenticate": "Bearer"}


def _unauthorized(message: str) -> ApiError:
    return ApiError(401, ErrorCode.UNAUTHORIZED, message, headers=BEARER_HEADERS)


async def api_key(request: Request) -> ApiKey:
    """The calling key, or 401 (missing, malformed, unknown or revoked key)."""
    cached = getattr(request.state, "api_key", None)
    if isinstance(cached, ApiKey):
        return cached
    scheme, secret = get_authorization_scheme_param(request.headers.get("authorization"))
    if not secret or scheme.lower() != "bearer":
        raise _unauthorized("missing API key: send `Authorization: Bearer <key>`")
    if not api_keys.looks_like_key(secret):
        raise _unauthorized("invalid API key")
    hashed = api_keys.digest(secret)
    redis = request.app.state.gateway.redis
    raw: dict[str, str] = await redis.hgetall(keys.api_key_record(hashed))
    if not raw:
        raise _unauthorized("invalid API key")
    key = ApiKey.from_fields(raw)
    if not key.is_active:
        log.info("refused revoked key %s", key.id)
        raise _unauthorized("this API key was revoked")
    request.state.api_key = key
    return key


async def require_admin(request: Request) -> ApiKey:
    key = await api_key(request)
    if not key.is_admin:
        raise ApiError(403, ErrorCode.FORBIDDEN, "an admin key is needed for fleet stats")
    return key


def may_access(key: ApiKey, owner: str | None) -> bool:
    return key.is_admin or (owner is not None and owner == key.id)


async def owned_resources(request: Request) -> ApiKey:
    """The calling key, after checking that the job or batch named in the path (if any) is its own: 404 if not."""
    key = await api_key(request)
    redis = request.app.state.gateway.redis
    for param, hash_of, what in (
        ("job_id", keys.job_hash, "job"),
        ("batch_id", keys.batch_hash, "batch"),
    ):
        resource_id = request.path_params.get(param)
        if resource_id is None or key.is_admin:
            continue
        owner: str | None = await redis.hget(hash_of(resource_id), keys.OWNER_FIELD)
        if not may_access(key, owner):
            raise ApiError(404, ErrorCode.NOT_FOUND, f"no {what} {resource_id}", field=param)
    return key


async def num_active_keys(redis: Redis) -> int:
    index: dict[str, str] = await redis.hgetall(keys.API_KEYS_INDEX)  # type: ignore[assignment]
    num = 0
    for hashed in index.values():
        if await redis.hget(keys.api_key_record(hashed), "id") and not await redis.hget(
            keys.api_key_record(hashed), "revoked_at"
        ):
            num += 1
    return num
