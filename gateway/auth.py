"""Who is calling: `Authorization: Bearer <key>` -> the key's record (one HGETALL of its SHA-256, no cache, so a
revoked key is refused on its next request), and which jobs and batches that key may touch.

A key sees only what it created: another tenant's job or batch id answers 404, exactly as an unknown id does
(a 403 would confirm that the id exists). An admin key sees every job and batch, and the fleet's stats.
The secret never reaches a log line: only the key id does.
"""

import logging
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from redis.asyncio import Redis

from gateway.errors import ApiError
from shared import api_keys, keys, logs
from shared.api_keys import ApiKey
from shared.job_state import ErrorCode

log = logging.getLogger(__name__)

BEARER_HEADERS = {"WWW-Authenticate": "Bearer"}


def _unauthorized(message: str) -> ApiError:
    return ApiError(401, ErrorCode.UNAUTHORIZED, message, headers=BEARER_HEADERS)


BEARER = HTTPBearer(auto_error=False, description="An API key (`specfleet keys create NAME`)")
Credentials = Annotated[HTTPAuthorizationCredentials | None, Depends(BEARER)]


async def api_key(request: Request, credentials: Credentials) -> ApiKey:
    """The calling key, or 401 (missing, malformed, unknown or revoked key)."""
    if credentials is None or not credentials.credentials:
        raise _unauthorized("missing API key: send `Authorization: Bearer <key>`")
    secret = credentials.credentials
    if not api_keys.looks_like_key(secret):
        raise _unauthorized("invalid API key")
    redis = request.app.state.gateway.redis
    raw: dict[str, str] = await redis.hgetall(keys.api_key_record(api_keys.digest(secret)))
    if not raw:
        raise _unauthorized("invalid API key")
    key = ApiKey.from_fields(raw)
    if not key.is_active:
        log.info("refused revoked key %s", key.id)
        raise _unauthorized("this API key was revoked")
    logs.KEY_NAME.set(key.name)  # this request's log records name the key (never its secret)
    return key


CallerDep = Annotated[ApiKey, Depends(api_key)]


async def require_admin(key: CallerDep) -> ApiKey:
    if not key.is_admin:
        raise ApiError(403, ErrorCode.FORBIDDEN, "an admin key is needed for fleet stats")
    return key


def may_access(key: ApiKey, owner: str | None) -> bool:
    return key.is_admin or (owner is not None and owner == key.id)


async def owned_resources(request: Request, key: CallerDep) -> ApiKey:
    """The calling key, after checking that the job or batch named in the path (if any) is its own: 404 if not."""
    redis = request.app.state.gateway.redis
    for param, hash_of, what in (
        ("job_id", keys.job_hash, "job"),
        ("batch_id", keys.batch_hash, "batch"),
    ):
        resource_id = request.path_params.get(param)
        if param == "job_id" and resource_id is not None:
            logs.JOB_ID.set(resource_id)
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
