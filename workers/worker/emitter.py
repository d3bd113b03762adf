"""Writing one engine step's results to Redis: every job's new tokens, and the finish of finished jobs,
in ONE pipelined round trip (EMIT and FINISH scripts, shared/lua.py). A job that is no longer this
attempt's (cancelled, reclaimed by another worker, finished) comes back as `gone` so the worker drops it.
"""

from dataclasses import dataclass, field

import redis

from shared import keys, lua
from shared.job_record import token_ids_csv
from shared.job_state import ErrorCode, JobStatus
from shared.schemas import DoneEvent, ErrorEvent, ErrorInfo, TokenEvent, Usage, metrics_from
from shared.settings import ServiceSettings
from workers.engine.outputs import StepOutput


@dataclass
class Running:
    """A held job inside the engine: its attempt and its token counts so far."""

    job_id: str
    attempt: int
    prompt_tokens: int  # of the original prompt (a resumed attempt's prompt also holds earlier output)
    completion_tokens: int = 0  # all attempts together
    metrics: dict[str, float] = field(default_factory=dict)


class Emitter:
    def __init__(self, client: redis.Redis, settings: ServiceSettings) -> None:
        self.redis = client
        self._ctx = lua.context(settings.events_maxlen, settings.result_ttl_s)
        self._emit = client.register_script(lua.EMIT)
        self._finish = client.register_script(lua.FINISH)

    def emit(self, running: dict[str, Running], outputs: list[StepOutput]) -> tuple[list[str], list[str]]:
        """Write `outputs` (one engine step) -> (job ids finished now, job ids no longer this worker's)."""
        pipe = self.redis.pipeline(transaction=False)
        calls: list[tuple[str, bool]] = []  # (job id, is a finish) per script call, in pipeline order
        for out in outputs:
            job = running.get(out.request_id)
            if job is None:
                continue
            if out.new_token_ids:
                job.completion_tokens += len(out.new_token_ids)
                event = TokenEvent(text=out.new_text, token_ids=out.new_token_ids).model_dump_json()
                self._emit(
                    keys=[keys.job_hash(job.job_id), keys.job_events(job.job_id)],
                    args=[
                        self._ctx,
                        job.job_id,
                        job.attempt,
                        out.new_text,
                        token_ids_csv(out.new_token_ids),
                        len(out.new_token_ids),
                        job.prompt_tokens,
                        event,
                    ],
                    client=pipe,
                )
                calls.append((job.job_id, False))
            if out.finished:
                self._queue_success(pipe, job, out.finish_reason, out.metrics)
                calls.append((job.job_id, True))
        if not calls:
            return [], []
        finished, gone = [], []
        for (job_id, is_finish), result in zip(calls, pipe.execute(), strict=True):
            if result != "ok":
                gone.append(job_id)
            elif is_finish:
                finished.append(job_id)
        return [j for j in finished if j not in gone], list(dict.fromkeys(gone))

    def _queue_success(
        self, pipe: redis.client.Pipeline, job: Running, finish_reason: str | None, metrics: dict[str, float]
    ) -> None:
        usage = Usage(prompt_tokens=job.prompt_tokens, completion_tokens=job.completion_tokens)
        job_metrics = metrics_from(metrics)
        done = DoneEvent(
            status=JobStatus.SUCCEEDED, finish_reason=finish_reason, usage=usage, metrics=job_metrics
        )
        self._finish(
            keys=[keys.job_hash(job.job_id), keys.job_events(job.job_id)],
            args=[
                self._ctx,
                job.job_id,
                JobStatus.SUCCEEDED.value,
                job.attempt,
                "done",
                done.model_dump_json(),
                "finish_reason",
                finish_reason or "",
                "metrics",
                job_metrics.model_dump_json(exclude_none=True),
                "prompt_tokens",
                job.prompt_tokens,
            ],
            client=pipe,
        )

    def fail(
        self, job_id: str, attempt: int, code: ErrorCode, message: str, field_name: str | None = None
    ) -> str:
        """Finish a held job as failed (e.g. the engine refused it) -> 'ok' | 'lost' | its status."""
        info = ErrorInfo(code=code, message=message, field=field_name)
        event = ErrorEvent(status=JobStatus.FAILED, error=info).model_dump_json(exclude_none=True)
        result = self._finish(
            keys=[keys.job_hash(job_id), keys.job_events(job_id)],
            args=[
                self._ctx,
                job_id,
                JobStatus.FAILED.value,
                attempt,
                "error",
                event,
                "error",
                info.model_dump_json(exclude_none=True),
            ],
        )
        return str(result)
