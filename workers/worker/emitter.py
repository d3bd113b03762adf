"""Writing one engine step's results to Redis: every job's new tokens, and the finish (or failure) of the
jobs that ended, as ONE call of the STEP script (shared/lua.py: EMIT's and FINISH's work per job, in order). A job that is no
longer this attempt's (cancelled, reclaimed by another worker, finished) comes back as `gone` so the worker
drops it.

Two halves, so the worker's loop does only the cheap one:
    writes_for(running, outputs)   loop thread: count tokens, snapshot what to write (plain JobWrite values)
    queue(pipe, writes) / settle   writer process: build the events and the script call; read the replies
`emit()` does both in one call and executes the pipeline (tests, and anything that writes in step).
A STEP call touches one partition (shared/keys.py: one hash tag): a step whose jobs live in several partitions
is one STEP call per partition (keys.by_partition).
"""

from dataclasses import dataclass, field
from typing import Any

import redis

from shared import keys, lua
from shared.job_record import token_ids_csv
from shared.job_state import ErrorCode, JobStatus
from shared.logprobs import TokenLogprob
from shared.schemas import DoneEvent, ErrorEvent, ErrorInfo, TokenEvent, Usage, metrics_from
from shared.settings import ServiceSettings
from workers.engine.outputs import StepOutput
from workers.worker.logprobs import JobLogprobs

# token event field -> the JobWrite field it comes from; an event leaves them out when the job did not ask
_LOGPROB_FIELDS = {"logprobs": "new_logprobs", "prompt_logprobs": "prompt_logprobs"}


@dataclass
class Running:
    """A held job inside the engine: its attempt and its token counts so far."""

    job_id: str
    attempt: int
    prompt_tokens: int  # of the original prompt (a resumed attempt's prompt also holds earlier output)
    completion_tokens: int = 0  # all attempts together
    metrics: dict[str, float] = field(default_factory=dict)
    logprobs: JobLogprobs | None = None  # the request asked for logprobs or prompt_logprobs
    wants_token_logprobs: bool = False  # ... for its output tokens


@dataclass(frozen=True)
class JobFailure:
    code: ErrorCode
    message: str
    field_name: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)  # what the attempt ran up (a timeout: compute_s, cost)


@dataclass(frozen=True)
class JobWrite:
    """What one step writes for one job, snapshotted on the loop thread (immutable from then on)."""

    job_id: str
    attempt: int
    prompt_tokens: int
    completion_tokens: int  # after this step's tokens
    new_text: str = ""
    new_token_ids: tuple[int, ...] = ()
    finish_reason: str | None = None  # with is_finished: the job succeeded
    is_finished: bool = False
    metrics: dict[str, float] = field(default_factory=dict)
    failure: JobFailure | None = None  # the job failed (the engine refused it)
    new_logprobs: tuple[TokenLogprob, ...] | None = None  # with the request's logprobs: one per new token
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None  # with prompt_logprobs: on the first token write
    record_fields: tuple[str, ...] = ()  # more job hash fields written with the finish (name, value, ...)
    cached_tokens: int = 0  # with is_finished: its prompt tokens the engine's prefix cache held

    def wire(self) -> tuple[Any, ...]:
        """The write as a plain tuple of its fields, in order: what the loop pickles for its writer process. A
        dataclass pickles through its class's reduce path; right after an engine step has left the caches cold
        that cost ~5x a tuple's (14 vs 3 us a one-token write, 2026-12-04)."""
        return (self.job_id, self.attempt, self.prompt_tokens, self.completion_tokens, self.new_text,
                self.new_token_ids, self.finish_reason, self.is_finished, self.metrics, self.failure,
                self.new_logprobs, self.prompt_logprobs, self.record_fields, self.cached_tokens)  # fmt: skip

    @classmethod
    def of_wire(cls, wire: tuple[Any, ...]) -> "JobWrite":
        return cls(*wire)


@dataclass(frozen=True)
class Call:
    """One script call queued on a pipeline: whose, and whether it ends the job."""

    job_id: str
    is_final: bool


class Emitter:
    def __init__(self, client: redis.Redis, settings: ServiceSettings) -> None:
        self.redis = client
        self._contexts = lua.contexts(settings.events_maxlen, settings.result_ttl_s, settings.redis_partitions)
        self._step = client.register_script(lua.STEP)

    # -- loop thread ----------------------------------------------------------------------------------------
    @staticmethod
    def writes_for(running: dict[str, Running], outputs: list[StepOutput]) -> list[JobWrite]:
        """One step's outputs of the jobs in `running` -> what to write (their token counts move on)."""
        writes = []
        for out in outputs:
            job = running.get(out.request_id)
            if job is None or not (out.new_token_ids or out.finished):
                continue
            job.completion_tokens += len(out.new_token_ids)
            new_logprobs, prompt_logprobs = job.logprobs.add(out) if job.logprobs is not None else (None, None)
            record_fields = (
                job.logprobs.record_fields(job.wants_token_logprobs)
                if job.logprobs is not None and out.finished
                else []
            )
            writes.append(
                JobWrite(
                    job_id=job.job_id,
                    attempt=job.attempt,
                    prompt_tokens=job.prompt_tokens,
                    completion_tokens=job.completion_tokens,
                    new_text=out.new_text,
                    new_token_ids=tuple(out.new_token_ids),
                    finish_reason=out.finish_reason,
                    is_finished=out.finished,
                    metrics=dict(out.metrics) if out.finished else {},
                    new_logprobs=tuple(new_logprobs) if new_logprobs is not None else None,
                    prompt_logprobs=tuple(prompt_logprobs) if prompt_logprobs is not None else None,
                    record_fields=tuple(record_fields),
                    cached_tokens=min(out.num_cached_tokens, job.prompt_tokens) if out.finished else 0,
                )
            )
        return writes

    @staticmethod
    def failure(job_id: str, attempt: int, failure: JobFailure) -> JobWrite:
        return JobWrite(job_id=job_id, attempt=attempt, prompt_tokens=0, completion_tokens=0, failure=failure)

    # -- writer process --------------------------------------------------------------------------------------
    def step_call(self, writes: list[JobWrite]) -> tuple[list[str], list[str | int], list[Call]]:
        """KEYS and ARGV of the STEP script for `writes` (jobs of ONE partition), and one Call per reply it will
        give."""
        partitions = {keys.partition_of(write.job_id) for write in writes}
        if len(partitions) > 1:
            raise ValueError(f"one STEP call writes jobs of one partition, not of {sorted(partitions)}")
        call_keys: list[str] = []
        args: list[str | int] = [self._contexts[partitions.pop() if partitions else 0]]
        calls = []
        for write in writes:
            job_keys = [keys.job_hash(write.job_id), keys.job_events(write.job_id)]
            if write.failure is not None:
                call_keys += job_keys
                args += self._failure_args(write.job_id, write.attempt, write.failure)
                calls.append(Call(write.job_id, is_final=True))
                continue
            if write.new_token_ids:
                call_keys += job_keys
                args += self._token_args(write)
                calls.append(Call(write.job_id, is_final=False))
            if write.is_finished:
                call_keys += job_keys
                args += self._success_args(write)
                calls.append(Call(write.job_id, is_final=True))
        return call_keys, args, calls

    def queue(self, pipe: redis.client.Pipeline, writes: list[JobWrite]) -> list[Call]:
        """Queue ONE STEP call for `writes` (of one partition) on `pipe` (none when there is nothing to write)
        -> its Calls."""
        call_keys, args, calls = self.step_call(writes)
        if calls:
            pipe.evalsha(self._step.sha, len(call_keys), *call_keys, *args)
        return calls

    @property
    def step_sha(self) -> str:
        return str(self._step.sha)

    def load_script(self) -> None:
        """(Re)load the STEP script: after a NOSCRIPT reply (a restarted or flushed Redis)."""
        self._step.sha = self.redis.script_load(lua.STEP)

    @staticmethod
    def settle(calls: list[Call], replies: list[object]) -> tuple[list[str], list[str]]:
        """The replies of `calls` -> (job ids ended now, job ids no longer this worker's)."""
        ended, gone = [], []
        for call, reply in zip(calls, replies, strict=True):
            if reply != "ok":
                gone.append(call.job_id)
            elif call.is_final:
                ended.append(call.job_id)
        return [j for j in ended if j not in gone], list(dict.fromkeys(gone))

    def emit(self, running: dict[str, Running], outputs: list[StepOutput]) -> tuple[list[str], list[str]]:
        """Write `outputs` (one engine step) now, one round trip per partition -> (job ids finished now, ids no
        longer ours)."""
        ended: list[str] = []
        gone: list[str] = []
        for writes in keys.by_partition(self.writes_for(running, outputs), lambda write: write.job_id).values():
            call_keys, args, calls = self.step_call(writes)
            if calls:
                ended_now, gone_now = self.settle(calls, self._step(keys=call_keys, args=args))
                ended += ended_now
                gone += gone_now
        return ended, gone

    def _token_args(self, write: JobWrite) -> list[str | int]:
        token_ids = list(write.new_token_ids)
        event = TokenEvent(
            text=write.new_text,
            token_ids=token_ids,
            logprobs=list(write.new_logprobs) if write.new_logprobs is not None else None,
            prompt_logprobs=list(write.prompt_logprobs) if write.prompt_logprobs is not None else None,
        ).model_dump_json(exclude={name for name in _LOGPROB_FIELDS if getattr(write, _LOGPROB_FIELDS[name]) is None})
        return ["emit", write.job_id, write.attempt, write.new_text, token_ids_csv(token_ids), len(token_ids),
                write.prompt_tokens, event, write.completion_tokens - len(token_ids)]  # fmt: skip

    def _success_args(self, write: JobWrite) -> list[str | int]:
        usage = Usage(prompt_tokens=write.prompt_tokens, completion_tokens=write.completion_tokens,
                      cached_tokens=write.cached_tokens or None)  # fmt: skip
        job_metrics = metrics_from(write.metrics)
        done = DoneEvent(
            status=JobStatus.SUCCEEDED, finish_reason=write.finish_reason, usage=usage, metrics=job_metrics
        )
        fields: list[str | int] = [
            "finish_reason", write.finish_reason or "",
            "metrics", job_metrics.model_dump_json(exclude_none=True),
            "prompt_tokens", write.prompt_tokens,
            *(("cached_tokens", write.cached_tokens) if write.cached_tokens else ()),
            *write.record_fields,
        ]  # fmt: skip
        return ["finish", write.job_id, write.attempt, JobStatus.SUCCEEDED.value, "done", done.model_dump_json(),
                len(fields), *fields]  # fmt: skip

    @staticmethod
    def _failure_args(job_id: str, attempt: int, failure: JobFailure) -> list[str | int]:
        info = ErrorInfo(code=failure.code, message=failure.message, field=failure.field_name)
        event = ErrorEvent(status=JobStatus.FAILED, error=info).model_dump_json(exclude_none=True)
        fields: list[str | int] = ["error", info.model_dump_json(exclude_none=True)]
        if failure.metrics:
            fields += ["metrics", metrics_from(failure.metrics).model_dump_json(exclude_none=True)]
        return ["finish", job_id, attempt, JobStatus.FAILED.value, "error", event, len(fields), *fields]

    def fail(
        self, job_id: str, attempt: int, code: ErrorCode, message: str, field_name: str | None = None
    ) -> str:
        """Finish a held job as failed now (e.g. the engine refused it) -> 'ok' | 'lost' | its status."""
        write = self.failure(job_id, attempt, JobFailure(code, message, field_name))
        call_keys, args, _ = self.step_call([write])
        return str(self._step(keys=call_keys, args=args)[0])
