"""Prometheus metrics of one gateway process."""

from prometheus_client import Counter, Gauge, Histogram

JOBS_SUBMITTED = Counter("specfleet_jobs_submitted_total", "Jobs accepted by POST /v1/jobs", ["priority"])
JOBS_REJECTED = Counter("specfleet_jobs_rejected_total", "Submits refused", ["reason"])
JOBS_CANCELLED = Counter("specfleet_jobs_cancelled_total", "Jobs cancelled through the API")
SUBMIT_SECONDS = Histogram(
    "specfleet_submit_seconds",
    "Time to accept a job (without Prefer: wait)",
    buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5),
)
SSE_STREAMS = Gauge("specfleet_sse_streams", "Open SSE streams")
SSE_EVENTS = Counter("specfleet_sse_events_total", "Events sent to SSE clients", ["type"])
QUEUE_DEPTH = Gauge("specfleet_queue_depth", "Entries in a queue stream (waiting or held)", ["priority"])
WORKERS_ALIVE = Gauge("specfleet_workers_alive", "Workers with a recent heartbeat")
