"""Prometheus metrics of the Celery worker, served on `/metrics` at settings.tasks_metrics_port (0 = off).

The Celery worker is one process (a thread pool), so the default registry holds the whole picture. The server
starts with the worker (`worker_init`, wired in workers/tasks/celery_app.py), whichever command started it.
"""

import logging

from prometheus_client import Counter, start_http_server

from shared.gc_pauses import process_metrics
from shared.settings import ServiceSettings

log = logging.getLogger(__name__)

WEBHOOK_DELIVERIES = Counter(
    "specfleet_webhook_deliveries",
    "Webhook messages whose delivery ended: delivered, failed (attempts exhausted) or gone (410)",
    ["state"],
)
WEBHOOK_RETRIES = Counter("specfleet_webhook_retries", "Webhook attempts that failed and were retried")
GC = process_metrics()  # the process's collector pauses (observed from worker_init: celery_app.py)
for _state in ("delivered", "failed", "gone"):
    WEBHOOK_DELIVERIES.labels(_state)  # every state exported from the start (0)


def serve(settings: ServiceSettings) -> int | None:
    """Serve /metrics in a background thread when settings.tasks_metrics_port is set; returns the port."""
    if not settings.tasks_metrics_port:
        return None
    server, _ = start_http_server(settings.tasks_metrics_port, addr=settings.host)
    port = int(server.server_port)
    log.info("tasks metrics at http://%s:%d/metrics", settings.host, port)
    return port
