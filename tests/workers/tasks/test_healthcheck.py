"""The Celery worker's health check: healthy while its outbox bridge reads, not before it starts."""

import socket

import redis

from shared.settings import ServiceSettings
from tests.helpers.tasks import CeleryWorker
from workers.tasks.healthcheck import bridge_alive


def test_health_follows_the_bridge(hook_settings: ServiceSettings, rclient: redis.Redis, tmp_path) -> None:  # noqa: ANN001
    assert not bridge_alive(rclient, "test@nowhere")
    with CeleryWorker(hook_settings, tmp_path / "celery.log").start() as celery:
        assert bridge_alive(rclient, f"test@{socket.gethostname()}")
        assert not bridge_alive(rclient, "other@host")
        assert celery.process is not None
