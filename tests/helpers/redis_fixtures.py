"""One real redis-server per test session (flushed per test), service settings pointing at it with fast
timings, API keys in it, and jobs queued straight through the SUBMIT script."""

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from shared import keys, lua
from shared import redis_url as redis_urls
from shared.api_keys import ApiKey, KeyRegistry
from shared.redis_server import RedisServer
from shared.schemas import JobRequest
from shared.settings import ServiceSettings
from shared.submit import submit_call

FAST_TIMINGS = {
    "heartbeat_interval_s": 0.2,
    "claim_timeout_s": 1.0,
    "reclaim_interval_s": 0.2,
    "sse_keepalive_s": 1.0,
    "idle_block_ms": 50,
    "model_info_refresh_s": 0.0,
    "shutdown_grace_s": 0.0,
    "warm_up": False,  # 1-3 s per in-thread worker on the tiny models; tests/workers/worker/test_warmup.py runs it
}


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    with RedisServer(tmp_path_factory.mktemp("redis"), appendonly=False) as server:
        yield server


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    client.close()
    return redis_server.url


@pytest.fixture
def rclient(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    yield client
    client.close()


@pytest.fixture
def settings(redis_url: str, tmp_path: Path) -> ServiceSettings:
    return ServiceSettings(redis_url=redis_url, redis_dir=tmp_path / "redis", **FAST_TIMINGS)  # type: ignore[arg-type]


def create_key(
    redis_url: str, name: str = "test", num_partitions: int = 1, **limits: object
) -> tuple[ApiKey, str]:
    """A new API key in the test Redis (unlimited unless limits are given) -> (its record, its secret), in its
    tenant's partition of `num_partitions` (settings.redis_partitions of the gateway that will read it)."""
    client = redis_urls.client(redis_url, decode_responses=True)
    try:
        options = {"requests_per_min": 0, "tokens_per_min": 0, "max_concurrent_jobs": 0, **limits}
        return KeyRegistry(client, num_partitions).create(name, **options)  # type: ignore[arg-type]
    finally:
        client.close()


def tenant_keys(redis_url: str, num_partitions: int) -> list[tuple[ApiKey, str]]:
    """One new API key (a tenant) in each partition, by partition: new keys until every partition has one (a
    key's partition comes from its secret's digest, shared/keys.py tenant_partition)."""
    found: dict[int, tuple[ApiKey, str]] = {}
    for i in range(50 * num_partitions):
        key, secret = create_key(redis_url, f"tenant-{i}", num_partitions=num_partitions)
        found.setdefault(keys.partition_of(key.id), (key, secret))
        if len(found) == num_partitions:
            return [found[p] for p in range(num_partitions)]
    raise AssertionError(f"{50 * num_partitions} keys reached only partitions {sorted(found)}")


def submit_job(
    client: redis.Redis,
    settings: ServiceSettings,
    idempotency_key: str | None = None,
    partition: int = 0,
    **request: object,
) -> str:
    """Queue a job straight through the SUBMIT script (what POST /v1/jobs runs), without a gateway, in
    `partition` (shared/keys.py)."""
    body = JobRequest.model_validate({"prompt": "hello", **request})
    keys_, args = submit_call(body, keys.mark(uuid.uuid4().hex, partition), idempotency_key, settings)
    result = client.register_script(lua.SUBMIT)(keys=keys_, args=args)
    assert result[0] in ("ok", "dup"), result
    return str(result[1])


def job_record(client: redis.Redis, job_id: str) -> dict[str, str]:
    """The job's hash with its whole output (a running job's new tokens live in the output strings until it
    ends): what the gateway and the webhooks read (shared.lua READ_JOB). {} when there is no such job."""
    return lua.fields_of(client.eval(lua.READ_JOB, 3, *lua.read_job_keys(job_id)))
