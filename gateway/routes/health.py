"""Liveness, readiness (Redis reachable, workers alive) and Prometheus metrics."""

import time

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse, Response
from pydantic import BaseModel

from gateway.deps import AdminDep, GatewayDep
from gateway.errors import ERROR_RESPONSES, ApiError
from gateway.metrics import CONTENT_TYPE, QUEUE_DEPTH, QUEUE_OLDEST_AGE, WORKERS_ALIVE, render
from shared.job_state import ErrorCode
from shared.schemas import ErrorResponse

router = APIRouter(tags=["health"])

# /metrics answers text/plain, its errors JSON (the route's response_class would document them as text/plain)
METRICS_ERROR: dict[str, object] = {
    "description": "the error",
    "content": {"application/json": {"schema": ErrorResponse.model_json_schema()}},
}


class Health(BaseModel):
    status: str


class Readiness(BaseModel):
    status: str
    workers_alive: int
    queue_depth: dict[str, int]


@router.get("/healthz", response_model=Health)
async def healthz() -> Health:
    """The process serves HTTP."""
    return Health(status="ok")


@router.get("/readyz", response_model=Readiness, responses=ERROR_RESPONSES)
async def readyz(gw: GatewayDep) -> Readiness:
    """Ready when Redis answers and at least one worker heartbeats; else 503."""
    await gw.redis.ping()
    num_workers = await gw.store.num_workers_alive(time.time())
    if num_workers == 0:
        raise ApiError(503, ErrorCode.UNAVAILABLE, "no worker is alive", headers={"Retry-After": "5"})
    return Readiness(status="ready", workers_alive=num_workers, queue_depth=await gw.store.queue_depths())


@router.get(
    "/metrics",
    response_model=None,
    response_class=PlainTextResponse,
    responses={code: METRICS_ERROR for code in (401, 403, 503)},
)
async def metrics(gw: GatewayDep, admin: AdminDep) -> Response:
    """Prometheus text format (admin key only); queue depth, the oldest waiting job's age and live workers are
    read from Redis at scrape time."""
    now_s = time.time()
    for priority, depth in (await gw.store.queue_depths()).items():
        QUEUE_DEPTH.labels(priority).set(depth)
    for priority, age_s in (await gw.store.oldest_waiting_age_s()).items():
        QUEUE_OLDEST_AGE.labels(priority).set(age_s)
    WORKERS_ALIVE.set(await gw.store.num_workers_alive(now_s))
    return Response(render(), media_type=CONTENT_TYPE)
