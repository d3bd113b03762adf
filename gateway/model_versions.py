"""The model versions the fleet serves now: those of the workers heartbeating (keys.WORKER_VERSIONS)."""

import time

from redis.asyncio import Redis

from shared import keys


async def served_versions(redis: Redis, worker_ttl_s: float) -> list[str]:
    """Sorted distinct versions of the live workers (empty while none is alive)."""
    alive: list[str] = await redis.zrangebyscore(keys.WORKERS_ZSET, time.time() - worker_ttl_s, "+inf")  # type: ignore[assignment]
    if not alive:
        return []
    versions: list[str | None] = await redis.hmget(keys.WORKER_VERSIONS, alive)  # type: ignore[misc,assignment]
    return sorted({v for v in versions if v})
