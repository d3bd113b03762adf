"""Who is calling: `Authorization: Bearer <key>` -> the key's record (one HGETALL of its SHA-256, no cache, so a
revoked key is refused on its next request), and which jobs and batches that key may touch.

The submit routes (POST /v1/jobs, /v1/completions, /v1/chat/completions) do not look the key up on their own:
`submit_caller` keeps the digest (a `Caller`) and the submit's one script call (AUTH_ADMIT_SUBMIT, via
gateway/admission.py) reads the record, so auth, limits and the job cost one round trip. A submit refused before
that call (a body that fails validation, a prompt too long) checks its key first (`KeyFirstRoute`): an unknown
or revoked key answers 401 there too, as on every other route.

A key sees only what it created: another tenant's job or batch id answers 404, exactly as an unknown id does
(a 403 would confirm that the id exists). An admin key sees every job and batch, and the fleet's stats.
The secret never reaches a log line: only the key id does.
"""

import logging
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Annotated, Any, cast

from fastapi import Depends, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from redis.asyncio import Redis
from starlette.exceptions import HTTPException as StarletteHTTPException

from gateway.errors import ApiError
from gateway.store import JobStore
from shared import api_keys, keys, logs
from shared.api_keys import ApiKey
from shared.job_state import ErrorCode

log = logging.getLogger(__name__)

BEARER_HEADERS = {"WWW-Authenticate": "Bearer"}


def _unauthorized(message: str) -> ApiError:
    return ApiError(401, ErrorCode.UNAUTHORIZED, message, headers=BEARER_HEADERS)


BEARER = HTTPBearer(auto_error=False, description="An API key (`specfleet keys create NAME`)")
Credentials = Annotated[HTTPAuthorizationCredentials | None, Depends(BEARER)]


def _secret(credentials: HTTPAuthorizationCredentials | None) -> str:
    """The bearer's secret, or 401 (missing or malformed) before any Redis work."""
    if credentials is None or not credentials.credentials:
        raise _unauthorized("missing API key: send `Authorization: Bearer <key>`")
    if not api_keys.looks_like_key(credentials.credentials):
        raise _unauthorized("invalid API key")
    return credentials.credentials


def key_of(raw: dict[str, str]) -> ApiKey:
    """A key's record as read from Redis ({} when there is none) -> the key, or 401 (unknown or revoked)."""
    if not raw:
        raise _unauthorized("invalid API key")
    key = ApiKey.from_fields(raw)
    if not key.is_active:
        log.info("refused revoked key %s", key.id)
        raise _unauthorized("this API key was revoked")
    logs.KEY_NAME.set(key.name)  # this request's log records name the key (never its secret)
    return key


async def api_key(request: Request, credentials: Credentials) -> ApiKey:
    """The calling key, or 401 (missing, malformed, unknown or revoked key)."""
    secret = _secret(credentials)
    return key_of(await _record(request, api_keys.digest(secret)))


async def _record(request: Request, digest: str) -> dict[str, str]:
    """The record of the key with this digest ({} when there is none)."""
    gw = request.app.state.gateway
    return cast(dict[str, str], await gw.store.reads.call("HGETALL", _record_key(gw.store, digest)))


def _record_key(store: JobStore, digest: str) -> str:
    """Where the record of the key with this digest is: its tenant's partition."""
    return keys.api_key_record(digest, store.tenant_partition(digest))


@dataclass
class Caller:
    """The bearer of a submit, found in the submit's own script call (gateway/admission.py)."""

    digest: str  # SHA-256 hex of the secret: where the key's record is
    is_read: bool = False  # the record was read (valid or not: an invalid key was answered 401 then)


async def submit_caller(request: Request, credentials: Credentials) -> Caller:
    """A submit's caller: 401 now for a missing or malformed key; its record is read by the submit itself."""
    caller = request.state.caller = Caller(api_keys.digest(_secret(credentials)))
    return caller


async def check_unverified_caller(request: Request) -> None:
    """A submit refused before its script call read the key: read it now (401 if unknown or revoked)."""
    caller: Caller | None = getattr(request.state, "caller", None)
    if caller is None or caller.is_read:
        return
    caller.is_read = True
    key_of(await _record(request, caller.digest))


class KeyFirstRoute(APIRoute):
    """A route whose refusals answer 401 first when the caller's key was never read (`submit_caller`)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def key_first_handler(request: Request) -> Response:
            try:
                return await handler(request)
            except (ApiError, RequestValidationError, StarletteHTTPException):
                await check_unverified_caller(request)
                raise

        return key_first_handler


CallerDep = Annotated[ApiKey, Depends(api_key)]


async def require_admin(key: CallerDep) -> ApiKey:
    if not key.is_admin:
        raise ApiError(403, ErrorCode.FORBIDDEN, "an admin key is needed for fleet stats")
    return key


def may_access(key: ApiKey, owner: str | None) -> bool:
    return key.is_admin or (owner is not None and owner == key.id)


_PATH_RESOURCES = (("job_id", keys.job_hash, "job"), ("batch_id", keys.batch_hash, "batch"))


async def owned_resources(request: Request, credentials: Credentials) -> ApiKey:
    """The calling key, after checking that the job or batch named in the path (if any) is its own: 404 if not.
    One round trip: the key's record and the resource's owner and status are read together, in the loop turn's
    batch of reads (gateway/redis_batch.py); a 401 still comes before a 404. The status stays on the request
    (`resource_exists`), so a route need not read it again."""
    key, status = await read_owned(request.app.state.gateway.store, _secret(credentials), request.path_params)
    if status is not None:
        request.state.resource_status = status
    return key


async def read_owned(store: JobStore, secret: str, path_params: dict[str, Any]) -> tuple[ApiKey, str | None]:
    """(the key of `secret`, the status of the job or batch in `path_params` or None when it names none), in one
    round trip; 401 for a key that is unknown or revoked, then 404 for a resource that is not the key's own."""
    digest = api_keys.digest(secret)
    named = [
        (param, hash_of(resource_id), what, resource_id)
        for param, hash_of, what in _PATH_RESOURCES
        if (resource_id := path_params.get(param)) is not None
    ]
    record, *fields = await store.reads.calls(  # one batch, with other requests' reads of this loop turn
        ("HGETALL", _record_key(store, digest)),
        *(("HMGET", hash_key, keys.OWNER_FIELD, "status") for _, hash_key, _, _ in named),
    )
    key = key_of(cast(dict[str, str], record))
    owners = cast(list[list[str | None]], fields)
    found: str | None = None
    for (param, _, what, resource_id), (owner, status) in zip(named, owners, strict=True):
        if param == "job_id":
            logs.JOB_ID.set(resource_id)
        if not may_access(key, owner):
            raise ApiError(404, ErrorCode.NOT_FOUND, f"no {what} {resource_id}", field=param)
        found = status
    return key, found


def resource_exists(request: Request) -> bool:
    """Whether the job or batch in the path exists (as `owned_resources` read it)."""
    return getattr(request.state, "resource_status", None) is not None


async def num_active_keys(redis: Redis) -> int:
    index: dict[str, str] = await redis.hgetall(keys.API_KEYS_INDEX)  # type: ignore[assignment]
    num = 0
    for key_id, hashed in index.items():
        record = keys.api_key_record(hashed, keys.partition_of(key_id))  # an entry without record: skipped
        if await redis.hget(record, "id") and not await redis.hget(record, "revoked_at"):
            num += 1
    return num
