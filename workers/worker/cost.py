"""Cost per job: each job's share of engine time (`compute_s`) and its price (`cost`).

Every engine step's wall time is split across the jobs the step computed, in proportion to the tokens the
scheduler gave each (prompt-chunk tokens + the decoded token + draft lookahead: what the step's forward passes
scale with). Time the engine sits idle is charged to no job. `cost` = compute_s × price_per_worker_hour / 3600:
what the worker would cost if it were always busy, so a fleet's real bill is the sum of its jobs' costs over
its utilisation. Both land in the finished job's `metrics` (the job record and its API views, batch result
lines) and in the worker's Prometheus counters (workers/worker/engine_metrics.py).

Limits: a job resumed by another worker (reclaim, hand-back, `dlq retry`) reports the compute of its last
attempt only; Prometheus counts every attempt.
"""

from collections.abc import Mapping

from workers.engine.outputs import StepOutput

SECONDS_PER_HOUR = 3600.0


def scheduled_tokens(engine: object) -> dict[str, int]:
    """request id -> tokens the engine's last step computed for it (its plan: workers/engine/scheduler_output.py)."""
    plan = getattr(engine, "last_plan", None)
    if plan is None:
        return {}
    return {s.request_id: s.num_new_tokens + s.num_lookahead for s in plan.scheduled}


class CostMeter:
    """Accumulates engine seconds per held job; `finished` moves a job's total into its output's metrics."""

    def __init__(self, price_per_worker_hour: float) -> None:
        self.price_per_s = price_per_worker_hour / SECONDS_PER_HOUR
        self.compute_s: dict[str, float] = {}  # job id -> engine seconds so far (this attempt)

    def account(self, step_s: float, tokens: Mapping[str, int]) -> None:
        """Split one step's `step_s` over its jobs by their scheduled tokens."""
        total = sum(tokens.values())
        if total <= 0 or step_s <= 0:
            return
        for job_id, num_tokens in tokens.items():
            self.compute_s[job_id] = self.compute_s.get(job_id, 0.0) + step_s * num_tokens / total

    def cost_of(self, compute_s: float) -> float:
        return compute_s * self.price_per_s

    def take(self, job_id: str) -> tuple[float, float]:
        """The job's (compute_s, cost) so far; it is forgotten."""
        compute_s = self.compute_s.pop(job_id, 0.0)
        return compute_s, self.cost_of(compute_s)

    def finished(self, outputs: list[StepOutput]) -> list[tuple[float, float]]:
        """Put (compute_s, cost) into each finished output's metrics -> those pairs, for the counters."""
        taken = []
        for out in outputs:
            if out.finished:
                compute_s, cost = self.take(out.request_id)
                out.metrics["compute_s"] = compute_s
                out.metrics["cost"] = cost
                taken.append((compute_s, cost))
        return taken

    def forget(self, job_ids: list[str]) -> None:
        for job_id in job_ids:
            self.compute_s.pop(job_id, None)
