"""FastAPI dependencies as `Annotated` aliases.

One object, `Gateway`, holds what handlers use (built once per process in gateway/main.py's lifespan), so a
request solves one dependency, not five: the submit path is measured in microseconds.
Authentication (a later issue) becomes one more alias here (`ApiKeyDep`), added to the jobs router.
"""

from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request
from redis.asyncio import Redis

from gateway.prompt_limit import PromptLimit
from gateway.store import JobStore
from gateway.streaming import EventHub
from shared.settings import ServiceSettings


@dataclass
class Gateway:
    settings: ServiceSettings
    redis: Redis
    store: JobStore
    hub: EventHub
    prompt_limit: PromptLimit

    def base_url(self, request: Request) -> str:
        """Where `urls{}` point: settings.public_url, else the URL the client used."""
        return self.settings.public_url or str(request.base_url)


async def _gateway(request: Request) -> Gateway:
    return request.app.state.gateway  # type: ignore[no-any-return]


GatewayDep = Annotated[Gateway, Depends(_gateway)]
