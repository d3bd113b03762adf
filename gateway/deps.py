"""FastAPI dependencies as `Annotated` aliases.

One object, `Gateway`, holds what handlers use (built once per process in gateway/main.py's lifespan), so a
request solves one dependency, not five: the submit path is measured in microseconds.
Authentication: `ApiKeyDep` (the calling key), `OwnerDep` (the path's job or batch must be the key's),
`AdminDep` (fleet stats) and `SubmitCallerDep` (the submit routes: the key is read in the submit's own script
call), see gateway/auth.py.
"""

from dataclasses import dataclass, field
from typing import Annotated

from fastapi import Depends, Request
from redis.asyncio import Redis

from gateway.auth import Caller, api_key, owned_resources, require_admin, submit_caller
from gateway.prompt_limit import PromptLimit
from gateway.rate_limit import RateLimiter
from gateway.served_model import ServedModel
from gateway.store import JobStore
from gateway.streaming import EventHub
from shared.api_keys import ApiKey
from shared.settings import ServiceSettings

BASE_URLS_KEPT = 256  # base URLs remembered by (scheme, server, root path, Host); past this, start over


@dataclass
class Gateway:
    settings: ServiceSettings
    redis: Redis
    store: JobStore
    hub: EventHub
    prompt_limit: PromptLimit
    limiter: RateLimiter
    served_model: ServedModel

    _base_urls: dict[tuple[object, ...], str] = field(default_factory=dict, repr=False)

    def base_url(self, request: Request) -> str:
        """Where `urls{}` point: settings.public_url, else the URL the client used. Starlette builds that URL anew
        for every request (3 % of a submit's CPU); it depends only on the scheme, the server address, the root
        path and the Host header, so it is kept by those (a few hundred at most: Host is the client's to choose)."""
        if self.settings.public_url:
            return self.settings.public_url
        scope = request.scope
        host = next((value for name, value in scope["headers"] if name == b"host"), None)
        key = (scope.get("scheme"), scope.get("server"), scope.get("root_path", ""), host)
        found = self._base_urls.get(key)
        if found is None:
            if len(self._base_urls) >= BASE_URLS_KEPT:
                self._base_urls.clear()
            found = self._base_urls[key] = str(request.base_url)
        return found


async def _gateway(request: Request) -> Gateway:
    return request.app.state.gateway  # type: ignore[no-any-return]


GatewayDep = Annotated[Gateway, Depends(_gateway)]

ApiKeyDep = Annotated[ApiKey, Depends(api_key)]  # the calling key (401 without a valid one)
SubmitCallerDep = Annotated[Caller, Depends(submit_caller)]  # a submit's caller: its key is read by the submit
OwnerDep = Annotated[ApiKey, Depends(owned_resources)]  # ... and the path's job/batch is its own (else 404)
AdminDep = Annotated[ApiKey, Depends(require_admin)]  # ... and it is an admin key (else 403)
