"""The gateway app: thin FastAPI over Redis (jobs store, one pub/sub fan-out, prompt-length check)."""

import logging
import resource
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI
from fastapi.middleware.cors import CORSMiddleware
from fastapi.telemetry import TelemetryConfig
from redis.asyncio import Redis
from redis.exceptions import RedisError
from starlette.exceptions import HTTPException as StarletteHTTPException

from gateway.auth import num_active_keys, owned_resources
from gateway.body_limit import BodyLimit
from gateway.deps import Gateway
from gateway.errors import install_error_handlers
from gateway.metrics import GC, process_exiting
from gateway.openai_errors import shaped_http_error
from gateway.prompt_limit import PromptLimit
from gateway.rate_limit import RateLimiter
from gateway.redis_wire import WireConnection
from gateway.request_metrics import RequestMetrics
from gateway.routes import (
    batches,
    files,
    health,
    jobs,
    models,
    openai_chat,
    openai_completions,
    openai_responses,
)
from gateway.served_model import ServedModel
from gateway.store import JobStore
from gateway.stream_route import StreamShortPath
from gateway.streaming import EventHub
from shared import gc_pauses
from shared import redis_url as redis_urls
from shared.settings import ServiceSettings, get_settings

log = logging.getLogger(__name__)

# a full collection at most every 100 middle-generation ones (CPython: 10): a burst of SSE stream opens grows the
# heap by ~100 objects a stream, and each full collection in it walked them all (shared/gc_pauses.py)
FULL_COLLECTION_EVERY = 100


def raise_open_files_limit() -> int:
    """Each SSE stream holds one socket: take the soft limit on open files up to the hard one (thousands of
    streams per process need more than a common default of 1,024) -> the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError) as exc:  # e.g. an unlimited hard limit the kernel caps lower
            log.warning("open files limit stays at %d: %s", soft, exc)
    return int(soft)


def create_served_app() -> FastAPI:
    """The app `specfleet gateway` serves (uvicorn's factory, once per gateway process): create_app's, with this
    process's garbage collector timed, and settled once the app serves (shared/gc_pauses.py)."""
    gc_pauses.observe(GC)
    return create_app(settle_gc=True)


def create_app(settings: ServiceSettings | None = None, *, settle_gc: bool = False) -> FastAPI:
    """settle_gc: freeze what start-up left once the app is up (a process serving only this app; not in tests)."""
    settings = settings or get_settings()
    raise_open_files_limit()
    if settings.redis_url is None:
        raise ValueError("the gateway needs REDIS_URL (`specfleet up` starts a private Redis and sets it)")
    redis_url = settings.redis_url

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        redis = redis_urls.async_client(  # standalone: a blocking pool it owns (aclose() closes it)
            redis_url,
            max_connections=settings.redis_max_connections,
            decode_responses=True,
            health_check_interval=30,
        )
        # the batched commands' own connection (gateway/redis_wire.py; a Cluster: None, redis-py's client)
        wire = WireConnection.for_url(redis_url, redis.response_callbacks)
        gateway = app.state.gateway = Gateway(
            settings=settings,
            redis=redis,
            store=JobStore(redis, settings, wire),
            hub=EventHub(redis, redis_url, settings.sse_keepalive_s, wire=wire),
            prompt_limit=PromptLimit(redis, settings.model_info_refresh_s),
            limiter=RateLimiter(settings),
            served_model=ServedModel(redis, settings.served_model_name, settings.model_info_refresh_s),
        )
        if settings.env != "dev":
            try:
                await _require_keys(redis)
            except BaseException:
                await redis.aclose()
                if wire is not None:
                    wire.close()
                raise
        try:
            await gateway.store.ensure_groups()
        except RedisError as exc:  # serve anyway: requests answer 503 until Redis is back
            log.warning("redis at %s unavailable at startup: %s", redis_url, exc)
        await gateway.hub.start()
        if settle_gc:
            gc_pauses.settle(GC)
            gc_pauses.space_full_collections(FULL_COLLECTION_EVERY, GC)
        try:
            yield
        finally:
            await gateway.hub.stop()
            await redis.aclose()
            if wire is not None:
                wire.close()
            process_exiting()

    # FastAPI's own OpenTelemetry hooks are off: /metrics (Prometheus) is this service's telemetry.
    telemetry: TelemetryConfig = {"tracing": False, "metrics": False, "logs": False}
    app = FastAPI(title="specfleet", version="0.1.0", lifespan=lifespan, telemetry=telemetry)
    install_error_handlers(app)
    app.add_exception_handler(StarletteHTTPException, shaped_http_error)  # OpenAI's shape under its paths
    # every route but health needs a key; a job or batch id in the path must be the key's own (else 404)
    tenant = [Depends(owned_resources)]
    app.include_router(jobs.submit_router)  # its key is read by the submit's own script call (gateway/auth.py)
    app.include_router(jobs.router, dependencies=tenant)
    app.include_router(batches.router, dependencies=tenant)
    for router in (openai_completions.router, openai_chat.router, openai_responses.router, models.router, files.router):
        app.include_router(router)
    app.include_router(health.router)
    app.add_middleware(StreamShortPath)  # added first: innermost, beneath the counts, CORS and the body limit
    app.add_middleware(BodyLimit, settings=settings)
    if settings.cors_allow_origins:  # off by default
        app.add_middleware(
            CORSMiddleware,
            allow_origins=settings.cors_allow_origins,
            allow_methods=["GET", "POST"],
            allow_headers=["Authorization", "Content-Type", "Idempotency-Key", "Last-Event-ID", "Prefer"],
            expose_headers=["x-specfleet-job-id", "Retry-After", "Location"],
        )
    app.add_middleware(RequestMetrics)  # added last: outermost
    return app


async def _require_keys(redis: Redis) -> None:
    """Outside dev the gateway does not start without an active API key (`specfleet keys create`)."""
    try:
        num_keys = await num_active_keys(redis)
    except RedisError as exc:
        raise RuntimeError(
            f"cannot check the API keys (Redis unavailable: {exc}); refusing to start"
        ) from exc
    if num_keys == 0:
        raise RuntimeError(
            "no active API key: create one with `specfleet keys create NAME`; refusing to start"
        )
