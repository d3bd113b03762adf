"""The gateway app: thin FastAPI over Redis (jobs store, one pub/sub fan-out, prompt-length check)."""

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.telemetry import TelemetryConfig
from redis.asyncio import Redis
from redis.exceptions import RedisError

from gateway.deps import Gateway
from gateway.errors import install_error_handlers
from gateway.prompt_limit import PromptLimit
from gateway.routes import batches, health, jobs
from gateway.store import JobStore
from gateway.streaming import EventHub
from shared.settings import ServiceSettings, get_settings

log = logging.getLogger(__name__)


def create_app(settings: ServiceSettings | None = None) -> FastAPI:
    settings = settings or get_settings()
    if settings.redis_url is None:
        raise ValueError("the gateway needs REDIS_URL (`specfleet up` starts a private Redis and sets it)")
    redis_url = settings.redis_url

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        redis = Redis.from_url(redis_url, decode_responses=True, health_check_interval=30)
        gateway = app.state.gateway = Gateway(
            settings=settings,
            redis=redis,
            store=JobStore(redis, settings),
            hub=EventHub(redis, settings.sse_keepalive_s),
            prompt_limit=PromptLimit(redis, settings.model_info_refresh_s),
        )
        try:
            await gateway.store.ensure_groups()
        except RedisError as exc:  # serve anyway: requests answer 503 until Redis is back
            log.warning("redis at %s unavailable at startup: %s", redis_url, exc)
        await gateway.hub.start()
        try:
            yield
        finally:
            await gateway.hub.stop()
            await redis.aclose()

    # FastAPI's own OpenTelemetry hooks are off: /metrics (Prometheus) is this service's telemetry.
    telemetry: TelemetryConfig = {"tracing": False, "metrics": False, "logs": False}
    app = FastAPI(title="specfleet", version="0.1.0", lifespan=lifespan, telemetry=telemetry)
    install_error_handlers(app)
    app.include_router(jobs.router)
    app.include_router(batches.router)
    app.include_router(health.router)
    return app
