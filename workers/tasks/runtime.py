"""Per-process state of a Celery worker: its settings and one Redis client (thread-safe pool)."""

from functools import lru_cache
from typing import cast

import redis

from shared import redis_url as redis_urls
from shared.settings import ServiceSettings, get_settings
from shared.ssrf import Allowlist


def settings() -> ServiceSettings:
    return get_settings()


@lru_cache(maxsize=1)
def redis_client() -> redis.Redis:
    url = settings().redis_url
    if url is None:
        raise RuntimeError("the Celery worker needs REDIS_URL (`specfleet up` sets it)")
    return redis_urls.client(url, decode_responses=True, health_check_interval=30)


@lru_cache(maxsize=1)
def allowlist() -> Allowlist:
    return Allowlist.parse(settings().webhook_allow_hosts)


def base_url() -> str:
    """Base of the `urls{}` in webhook bodies: settings.public_url, else the gateway's host:port."""
    s = settings()
    return s.public_url or f"http://{s.host}:{s.port}"


def hgetall(key: str) -> dict[str, str]:
    """HGETALL on the decoding client, typed as what it returns."""
    return cast(dict[str, str], redis_client().hgetall(key))


def lrange(key: str, start: int, end: int) -> list[str]:
    return cast(list[str], redis_client().lrange(key, start, end))
