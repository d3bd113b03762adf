"""The worker's metrics per queue priority (issue 18), in the worker's registry:

specfleet_preemptions_total{priority}        counter: sequences preempted (KV freed, recomputed later),
                                             by the priority of the preempted job
specfleet_queue_wait_seconds{priority}       histogram: job created -> first started (Redis clock), first
                                             attempts only
specfleet_ttft_seconds{priority}             histogram: job given to the engine -> its first token, finished
                                             jobs (queue wait + this = the user's time to first token)
"""

from collections.abc import Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram

from shared.schemas import Priority
from workers.engine.outputs import StepOutput
from workers.worker.prompts import priority_of

QUEUE_WAIT_BUCKETS_S = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 1800.0, 7200.0)
TTFT_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class PriorityMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.preemptions = Counter(
            "specfleet_preemptions",
            "Sequences preempted, by the job's priority",
            ["priority"],
            registry=registry,
        )
        self.queue_wait = Histogram(
            "specfleet_queue_wait_seconds",
            "Job created -> first started, by priority",
            ["priority"],
            buckets=QUEUE_WAIT_BUCKETS_S,
            registry=registry,
        )
        self.ttft = Histogram(
            "specfleet_ttft_seconds",
            "Job given to the engine -> first token, by priority",
            ["priority"],
            buckets=TTFT_BUCKETS_S,
            registry=registry,
        )
        for priority in Priority:  # every priority exported from the start
            self.preemptions.labels(priority.value)
            self.queue_wait.labels(priority.value)
            self.ttft.labels(priority.value)

    def job_started(self, priority: Priority, queue_wait_s: float) -> None:
        self.queue_wait.labels(priority.value).observe(max(0.0, queue_wait_s))

    def step(self, engine: Any, outputs: list[StepOutput], leases: Mapping[str, Any]) -> None:
        """The step's preemptions (engine.last_plan) and the TTFT of jobs it finished (`leases`: job id -> the
        worker's Lease, which names its queue)."""
        plan = getattr(engine, "last_plan", None)
        for seq in plan.preempted if plan is not None else []:
            self.preemptions.labels(priority_of(seq.priority).value).inc()
        for out in outputs:
            lease = leases.get(out.request_id)
            if out.finished and lease is not None and "ttft_ms" in out.metrics:
                self.ttft.labels(lease.priority.value).observe(out.metrics["ttft_ms"] / 1e3)
