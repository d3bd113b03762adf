"""Tests that play the engine: real StepOutputs made by hand, and the worker's Redis side (take a job, emit
tokens, finish) driven by a test with the real scripts."""

import redis

from shared.settings import ServiceSettings
from tests.helpers.waiting import wait_until
from workers.engine.outputs import StepOutput


def step_output(
    request_id: str,
    new_token_ids: list[int],
    new_text: str,
    finish_reason: str | None = None,
    metrics: dict[str, float] | None = None,
) -> StepOutput:
    """What the engine would return for one request this step (finished when a finish reason is given)."""
    return StepOutput(
        request_id=request_id,
        new_token_ids=new_token_ids,
        new_text=new_text,
        finished=finish_reason is not None,
        finish_reason=finish_reason,
        num_prompt_tokens=3,
        num_output_tokens=len(new_token_ids),
        metrics=metrics or {},
    )


class PlayedWorker:
    """The worker's Redis side driven by a test: take a job, emit tokens, finish — with the real scripts."""

    def __init__(self, client: redis.Redis, settings: ServiceSettings, worker_id: str = "played") -> None:
        from workers.worker.emitter import Emitter
        from workers.worker.queue_reader import QueueReader

        self.reader = QueueReader(client, settings, worker_id)
        self.reader.ensure_groups()
        self.emitter = Emitter(client, settings)
        self.running: dict = {}

    def take(self, timeout_s: float = 10.0) -> str:
        from workers.worker.emitter import Running

        lease = wait_until(lambda: self.reader.pull(1), timeout_s, what="a job to take")[0]
        self.running[lease.job_id] = Running(
            lease.job_id, lease.attempt, prompt_tokens=3, completion_tokens=len(lease.resumed_token_ids)
        )
        return lease.job_id

    def emit(self, job_id: str, token_ids: list[int], text: str, finish_reason: str | None = None):  # noqa: ANN201
        return self.emitter.emit(self.running, [step_output(job_id, token_ids, text, finish_reason)])
