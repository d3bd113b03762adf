"""Prometheus metrics of the gateway, and how /metrics renders them.

`specfleet gateway --workers N` runs N processes on one port. They share one PROMETHEUS_MULTIPROC_DIR
(shared/cli/fleet.py sets it up, empty, before the processes start): prometheus-client then keeps each process's
values in a file there and `render()` adds them up, so every scrape, whichever process answers it, reports the
whole gateway. Gauges say how they combine: the ones set from Redis at scrape time take the most recent value,
open SSE streams add up over live processes. With one process and no such directory, the default registry.
"""

import os

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead

from shared.gc_pauses import process_metrics

MULTIPROC_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"
CONTENT_TYPE = CONTENT_TYPE_LATEST

JOBS_SUBMITTED = Counter("specfleet_jobs_submitted_total", "Jobs accepted by POST /v1/jobs", ["priority"])
JOBS_REJECTED = Counter("specfleet_jobs_rejected_total", "Submits refused", ["reason"])
JOBS_CANCELLED = Counter("specfleet_jobs_cancelled_total", "Jobs cancelled through the API")
SUBMIT_SECONDS = Histogram(
    "specfleet_submit_seconds",
    "Time to accept a job (without Prefer: wait)",
    buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5),
)
HTTP_RESPONSES = Counter(
    "specfleet_http_responses_total", "HTTP responses of the gateway, by status code", ["code"]
)
SSE_STREAMS = Gauge("specfleet_sse_streams", "Open SSE streams", multiprocess_mode="livesum")
SSE_EVENTS = Counter("specfleet_sse_events_total", "Events sent to SSE clients", ["type"])
# read from Redis by the process that answers the scrape
QUEUE_DEPTH = Gauge(
    "specfleet_queue_depth",
    "Entries in a queue stream (waiting or held)",
    ["priority"],
    multiprocess_mode="mostrecent",
)
QUEUE_OLDEST_AGE = Gauge(
    "specfleet_queue_oldest_age_seconds",
    "Age of the oldest job no worker has taken yet (0: none waiting)",
    ["priority"],
    multiprocess_mode="mostrecent",
)
WORKERS_ALIVE = Gauge(
    "specfleet_workers_alive", "Workers with a recent heartbeat", multiprocess_mode="mostrecent"
)
GC = process_metrics()  # the process's collector pauses, observed by the app `specfleet gateway` serves


def render() -> bytes:
    """The text exposition of the whole gateway: every process's values when several share the port."""
    if os.environ.get(MULTIPROC_DIR_ENV):
        registry = CollectorRegistry()
        MultiProcessCollector(registry)
        return generate_latest(registry)
    return generate_latest(REGISTRY)


def process_exiting() -> None:
    """This gateway process stops: its live gauges (open SSE streams) leave the sum the others report."""
    if os.environ.get(MULTIPROC_DIR_ENV):
        mark_process_dead(os.getpid())
