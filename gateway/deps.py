"""FastAPI dependencies as `Annotated` aliases; the objects live on `app.state` (built in gateway/main.py).

Authentication (a later issue) becomes one more alias here (`ApiKeyDep`), added to the jobs router.
"""

from typing import Annotated

from fastapi import Depends, Request
from redis.asyncio import Redis

from gateway.prompt_limit import PromptLimit
from gateway.store import JobStore
from gateway.streaming import EventHub
from shared.settings import ServiceSettings


async def _settings(request: Request) -> ServiceSettings:
    return request.app.state.settings  # type: ignore[no-any-return]


async def _redis(request: Request) -> Redis:
    return request.app.state.redis  # type: ignore[no-any-return]


async def _store(request: Request) -> JobStore:
    return request.app.state.store  # type: ignore[no-any-return]


async def _hub(request: Request) -> EventHub:
    return request.app.state.hub  # type: ignore[no-any-return]


async def _prompt_limit(request: Request) -> PromptLimit:
    return request.app.state.prompt_limit  # type: ignore[no-any-return]


async def base_url(request: Request) -> str:
    """Where `urls{}` point: settings.public_url, else the URL the client used."""
    configured: str | None = request.app.state.settings.public_url
    return configured or str(request.base_url)


SettingsDep = Annotated[ServiceSettings, Depends(_settings)]
RedisDep = Annotated[Redis, Depends(_redis)]
StoreDep = Annotated[JobStore, Depends(_store)]
HubDep = Annotated[EventHub, Depends(_hub)]
PromptLimitDep = Annotated[PromptLimit, Depends(_prompt_limit)]
BaseUrlDep = Annotated[str, Depends(base_url)]
