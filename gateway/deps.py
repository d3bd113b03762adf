"""FastAPI dependencies as `Annotated` aliases.

One object, `Gateway`, holds what handlers use (built once per process in gateway/main.py's lifespan), so a
request solves one dependency, not five: the submit path is measured in microseconds.
Authentication: `ApiKeyDep` (the calling key), `OwnerDep` (the path's job or batch must be the key's),
`AdminDep` (fleet stats) and `SubmitCallerDep` (the submit routes: the key is read in the submit's own script
call), see gateway/auth.py.
"""

from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request
from redis.asyncio import Redis

from gateway.auth import Caller, api_key, owned_resources, require_admin, submit_caller
from gateway.prompt_limit import PromptLimit
from gateway.rate_limit import RateLimiter
from gateway.store import JobStore
from gateway.streaming import EventHub
from shared.api_keys import ApiKey
from shared.settings import ServiceSettings


@dataclass
class Gateway:
    settings: ServiceSettings
    redis: Redis
    store: JobStore
    hub: EventHub
    prompt_limit: PromptLimit
    limiter: RateLimiter

    def base_url(self, request: Request) -> str:
        """Where `urls{}` point: settings.public_url, else the URL the client used."""
        return self.settings.public_url or str(request.base_url)


async def _gateway(request: Request) -> Gateway:
    return request.app.state.gateway  # type: ignore[no-any-return]


GatewayDep = Annotated[Gateway, Depends(_gateway)]

ApiKeyDep = Annotated[ApiKey, Depends(api_key)]  # the calling key (401 without a valid one)
SubmitCallerDep = Annotated[Caller, Depends(submit_caller)]  # a submit's caller: its key is read by the submit
OwnerDep = Annotated[ApiKey, Depends(owned_resources)]  # ... and the path's job/batch is its own (else 404)
AdminDep = Annotated[ApiKey, Depends(require_admin)]  # ... and it is an admin key (else 403)
