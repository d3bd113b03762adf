"""Container health checks: `python -m shared.healthcheck gateway|worker` (exit 0 = healthy).

gateway: GET /healthz on 127.0.0.1:$SPECFLEET_PORT answers 200.
worker:  a worker of this host (container) heartbeat within worker_ttl_s (the registry /readyz reads; worker
         ids start with the host name, see workers/worker/main.py).
"""

import socket
import sys
import time

from shared import redis_url as redis_urls


def gateway_ok() -> bool:
    import httpx

    from shared.settings import get_settings

    try:
        return httpx.get(f"http://127.0.0.1:{get_settings().port}/healthz", timeout=2.0).status_code == 200
    except httpx.TransportError:
        return False


def worker_ok() -> bool:
    import redis

    from shared import keys
    from shared.settings import get_settings

    settings = get_settings()
    if settings.redis_url is None:
        return False
    client = redis_urls.client(settings.redis_url, socket_timeout=2.0, decode_responses=True)
    try:
        alive: list[str] = client.zrangebyscore(  # type: ignore[assignment]
            keys.WORKERS_ZSET, time.time() - settings.worker_ttl_s, "+inf"
        )
        return any(member.startswith(f"{socket.gethostname()}-") for member in alive)
    except redis.RedisError:
        return False
    finally:
        client.close()


def main(argv: list[str]) -> int:
    checks = {"gateway": gateway_ok, "worker": worker_ok}
    if len(argv) != 1 or argv[0] not in checks:
        sys.stderr.write("usage: python -m shared.healthcheck gateway|worker\n")
        return 2
    return 0 if checks[argv[0]]() else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
