"""Container health check of `specfleet tasks`: exit 0 when this host's Celery worker's outbox bridge read
the outbox recently (it blocks at most a second per read, so its consumer idle time stays small).

    python -m workers.tasks.healthcheck [NODE_NAME]     (default: tasks@<hostname>, as `specfleet tasks`)
"""

import socket
import sys

import redis

from shared import keys
from shared import redis_url as redis_urls
from shared.settings import get_settings

MAX_IDLE_MS = 15_000


def bridge_alive(client: redis.Redis, node: str, num_partitions: int = 1) -> bool:
    """Whether the node's bridge of every partition's outbox read it recently."""
    for partition in range(num_partitions):
        try:
            consumers = client.xinfo_consumers(keys.outbox_stream(partition), keys.OUTBOX_GROUP)
        except redis.RedisError:
            return False
        if not any(c["name"] in (node, node.encode()) and int(c["idle"]) < MAX_IDLE_MS for c in consumers):
            return False
    return True


def main(argv: list[str]) -> int:
    node = argv[0] if argv else f"tasks@{socket.gethostname()}"
    settings = get_settings()
    url = settings.redis_url
    if url is None:
        return 1
    client = redis_urls.client(url, socket_timeout=3, socket_connect_timeout=3)
    try:
        return 0 if bridge_alive(client, node, settings.redis_partitions) else 1
    finally:
        client.close()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
