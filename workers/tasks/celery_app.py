"""The Celery app (Redis broker): retried, at-least-once side tasks. Inference stays in the engine workers.

    celery -A workers.tasks.celery_app worker --pool=threads --concurrency=4

Every task is acks_late (a worker that dies mid-task leaves it to be redelivered) and idempotent; no
result backend (tasks record what matters in the fleet's own keys). Celery's own Redis keys live under
keys.CELERY_KEY_PREFIX. The worker also runs the outbox bridge (workers/tasks/outbox.py).

This module imports no task module: the app includes them by name (TASK_MODULES, imported by the worker at
start), their shared tasks bind to it, and they register with workers/tasks/registry.py for the bridge.
"""

import logging

from celery import Celery
from celery.signals import worker_init, worker_ready

from shared import gc_pauses, keys
from shared.redis_url import celery_broker
from shared.settings import ServiceSettings, get_settings
from workers.tasks import metrics
from workers.tasks.outbox import OutboxStep

TASK_MODULES = ["workers.tasks.webhooks", "workers.tasks.batches"]
# Longer than any countdown a task retries with (webhook_retry_max_s): a reserved, not yet due task is
# redelivered after this (the Redis transport's visibility timeout).
VISIBILITY_TIMEOUT_S = 2 * 3600


def make_celery(settings: ServiceSettings) -> Celery:
    # Kombu has no Redis Cluster transport: with a Cluster REDIS_URL, the broker is celery_broker_url
    default_url = settings.redis_url or "redis://127.0.0.1:6379/0"
    broker_url, broker_options = celery_broker(default_url, settings.celery_broker_url)
    app = Celery("specfleet", broker=broker_url, include=TASK_MODULES)
    app.conf.update(
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        task_ignore_result=True,
        task_serializer="json",
        accept_content=["json"],
        task_default_queue=keys.CELERY_QUEUE,
        worker_prefetch_multiplier=1,
        worker_hijack_root_logger=False,
        worker_send_task_events=False,
        broker_connection_retry_on_startup=True,
        broker_transport_options={
            "global_keyprefix": keys.CELERY_KEY_PREFIX,
            "visibility_timeout": max(VISIBILITY_TIMEOUT_S, int(settings.webhook_retry_max_s) * 2),
            **broker_options,
        },
    )
    app.steps["worker"].add(OutboxStep)
    app.set_default()  # the shared tasks resolve to this app in every thread (pool threads, the bridge)
    return app


app = make_celery(get_settings())
logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per webhook attempt is ours already


@worker_init.connect
def _serve_metrics(**_: object) -> None:
    """The worker's /metrics (settings.tasks_metrics_port; 0 = off), however the worker was started."""
    gc_pauses.observe(metrics.GC)
    metrics.serve(get_settings())


@worker_ready.connect
def _settle_gc(**_: object) -> None:
    """Start-up's objects out of every later collection (shared/gc_pauses.py), however the worker was started."""
    gc_pauses.settle(metrics.GC)
