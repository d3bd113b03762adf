"""The worker process: one loop whose step reads like the data flow.

    step:  retire what was written -> admit what the puller started -> drop lost/cancelled jobs
           -> arm the puller with the engine's room, or pull (when due) what the engine can admit
           -> engine.step() -> emit (hand the step's writes to the writer process)
           (a worker that holds no job pulls first and reads its control channel after: nothing to drop before;
           the step after the idle wait pulled jobs goes straight to the engine: the next step reads it)
    each part's wall time is charged to a LoopClock (workers/worker/loop_time.py: specfleet_worker_loop_seconds)

Step N's writes (tokens, finishes, failures, webhook notices: ONE pipelined round trip, workers/worker/writer.py)
go to Redis from a process of their own while step N+1 computes (a thread would share the loop's GIL); a job is
retired (its lease forgotten) only once its final write landed. The loop pulls only when the engine has room
and jobs may be waiting (a pull left some, a job was queued since: keys.QUEUED_CHANNEL, or `reclaim_interval_s`
passed), and only as many as the engine admits. While the engine runs jobs and has room, those pulls are a
thread's (workers/worker/puller.py: setting `pull_while_stepping`), made while the engine steps, their jobs
admitted at a later boundary: the loop then pulls itself only to reclaim or to preempt, or with the engine empty.
Redis I/O stays here (queue_reader, puller, emitter, writer, heartbeat); the engine never sees Redis.
SIGTERM/SIGINT: stop pulling, keep stepping held jobs for up to `shutdown_grace_s`, hand the rest back to the queue.

Reports: the writer answers each round trip; while the engine runs jobs the loop takes those answers only every
writer_max_lag_ms / REPORTS_PER_MAX_LAG (5 ms by default), not every step: a read right after an engine step
runs with cold caches (its system call, the unpickling, the bookkeeping: 24 us p50 traced in a dev fleet, demo
pair, one client, 2026-12-07), ~2 % of a small model's step on a CPU. What waits meanwhile is never a token: a
finished job's retirement (its KV is free already), a `gone` report (the heartbeat and the control channel tell
those first), the writer's Redis error (its epoch's writes are skipped all the same), and the acknowledgements
that the writer's backpressure counts (`_is_behind` re-reads them itself before it would wait). With nothing in
the engine, or stopping, every step reads them.
"""

import logging
import os
import signal
import socket
import threading
import time
import uuid
from collections.abc import Callable
from types import FrameType
from typing import Any, Protocol

import redis

from shared import keys, logs
from shared.job_state import ErrorCode
from shared.schemas import Priority, StoredRequestError
from shared.settings import ServiceSettings
from workers.engine.errors import InvalidRequestError, PromptTooLongError
from workers.engine.outputs import StepOutput
from workers.engine.sampling_params import SamplingParams
from workers.worker.control import ControlChannel, ControlMessages
from workers.worker.cost import CostMeter, scheduled_tokens
from workers.worker.deadlines import Deadlines
from workers.worker.emitter import Emitter, JobFailure, JobWrite, Running
from workers.worker.engine_metrics import JobOutcome
from workers.worker.heartbeat import Heartbeat
from workers.worker.job_hooks import JobHooks
from workers.worker.logprobs import JobLogprobs, TokenTexts
from workers.worker.loop_time import LoopClock, LoopPart
from workers.worker.prompts import engine_priority, engine_prompt, sampling_params
from workers.worker.puller import Puller
from workers.worker.queue_reader import Lease, QueueReader
from workers.worker.stream_interval import TokenHold
from workers.worker.warmup import WarmupReport, warm_up
from workers.worker.writer import StepWrite, StepWriter

log = logging.getLogger(__name__)

REDIS_RETRY_S = 1.0  # pause after a failed Redis call before the loop tries again
REPORTS_PER_MAX_LAG = 4  # the loop takes the writer's reports at least this often within writer_max_lag_ms
RETIRE_WAIT_S = 0.05  # with nothing in the engine, how long one step waits for the writer's report
DRAIN_TIMEOUT_S = 10.0  # at shutdown, how long the loop waits for the writer to land what it holds
START_RETRY_MAX_S = 10.0  # a worker started before its Redis answers retries at most this far apart


class EngineLike(Protocol):
    """What the worker uses of workers.engine.Engine."""

    tokenizer: Any
    max_model_len: int

    def add_request(
        self, request_id: str, prompt: str | list[int], params: SamplingParams, priority: int = 0
    ) -> int: ...
    def step(self) -> list[StepOutput]: ...
    def abort(self, request_id: str) -> bool: ...
    def free_capacity(self) -> int: ...
    def free_capacity_for(self, priority: int) -> int: ...
    def room_after_waiting(self) -> int: ...


def new_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class Worker:
    def __init__(
        self,
        engine: EngineLike,
        client: redis.Redis,
        settings: ServiceSettings,
        *,
        worker_id: str | None = None,
        burst: bool = False,
        model_name: str = "",
        params_factory: Callable[..., Any] = sampling_params,
        metrics: Any = None,  # an EngineMetrics (workers/worker/engine_metrics.py), updated once per step
        io_cpus: frozenset[int] = frozenset(),  # the writer process and heartbeat run there; empty: anywhere
        on_started: Callable[[], Any] | None = None,  # after the warm-up, before the first heartbeat (the CLI's
        # worker settles its garbage collector there: shared/gc_pauses.py)
    ) -> None:
        self.engine = engine
        self.redis = client
        self.settings = settings
        self.worker_id = worker_id or new_worker_id()
        self.burst = burst  # exit once nothing is held and nothing is waiting (tests, batch runs)
        self.model_name = model_name
        self.params_factory = params_factory
        self.metrics = metrics
        self.clock: LoopClock = metrics.loop_clock if metrics is not None else LoopClock()  # the loop's time by part
        self.on_started = on_started
        self.reader = QueueReader(client, settings, self.worker_id)
        self.emitter = Emitter(client, settings)
        # pulls while the engine steps, where one PULL covers every queue (puller.py); else the loop's pulls only
        can_overlap = settings.pull_while_stepping and self.reader.pull_call() is not None
        self.puller = Puller(client) if can_overlap else None  # beside the loop, on the engine's cores
        self.token_texts = TokenTexts(engine.tokenizer)  # names the tokens of logprobs
        model_info = {
            "max_model_len": str(engine.max_model_len),
            "tokenizer_path": str(getattr(engine.tokenizer, "name_or_path", "") or ""),
            "vocab_size": str(len(engine.tokenizer)),  # the gateway refuses a prompt token id past it
            "model": model_name,
        }
        self.heartbeat = Heartbeat(client, settings, self.worker_id, self.held_leases, model_info, io_cpus)
        self.hooks = JobHooks(client, settings)  # webhook start/output notices
        self.writer = StepWriter(settings, io_cpus=io_cpus)  # a process of its own (writer_process.py)
        self.hold = TokenHold()  # tokens of jobs with a stream interval, between their writes
        self.deadlines = Deadlines(settings.job_timeout_s)  # execution deadlines of held jobs
        self.costs = CostMeter(settings.price_per_worker_hour)  # engine seconds per held job
        self._timed_out: set[str] = set()  # jobs whose `timeout` failure is written, not yet landed
        self.leases: dict[str, Lease] = {}  # job id -> queue entry + attempt (read by the heartbeat thread)
        self.running: dict[str, Running] = {}  # job id -> token counts, for jobs inside the engine
        self._leases_lock = threading.Lock()
        self._control = ControlChannel(client)  # cancels and "a job was queued"
        self.stop_deadline: float | None = None  # set on SIGTERM: hand back what is unfinished by then
        self.num_pulled_last = 0
        self.epoch = 0  # +1 after each Redis failure: the writer skips writes of a failed epoch
        self._pending = StepWrite(self.epoch)  # what admission wrote this step (failures, start notices)
        self._jobs_queued: set[Priority] = set(Priority)  # queues where a job may wait that no pull saw yet
        self._pull_in_flight = False  # the puller's, at the last boundary: the loop neither pulls nor arms it
        # announcements read meanwhile, weighed against the pulls' `last_ids` once that pull's reply is read
        self._announced_in_flight: dict[Priority, str | None] = {}
        self._pull_refused = False  # Redis refused the puller's last pull (streams lost): the loop pulls next
        self._last_pull_s = -float("inf")
        self.warmup: WarmupReport | None = None  # what start() ran before the first heartbeat
        self._woken_with_jobs = False  # the idle wait pulled jobs: the next step runs them first (_wait_and_pull)
        # with jobs in the engine, the writer's reports are taken this often (perf_counter seconds; "Reports" above)
        self._reports_interval_s = settings.writer_max_lag_ms / 1e3 / REPORTS_PER_MAX_LAG
        self._next_reports_s = -float("inf")

    @property
    def is_stopping(self) -> bool:
        return self.stop_deadline is not None

    def held_leases(self) -> list[Lease]:
        with self._leases_lock:
            return list(self.leases.values())

    # -- the loop ---------------------------------------------------------------------------------------
    def step(self) -> None:
        clock = self.clock
        if self._woken_with_jobs:  # the idle wait just pulled them: their first step at once (_wait_and_pull)
            self._woken_with_jobs = False
        else:
            self._before_engine()
        outputs: list[StepOutput] = []
        if self.running:
            outputs = self.engine.step()
            step_s = clock.charge(LoopPart.ENGINE)  # the step's own time: the clock was charged just before it
            clock.num_engine_steps += 1
            self._account(step_s, outputs)  # before the writes: a finished job's final write carries its cost
            clock.charge(LoopPart.CONTROL)
        self._emit(outputs)  # then the writes: a job's first tokens and its end wait for no metrics
        clock.charge(LoopPart.HAND_OFF)
        if self.metrics is not None:
            self.metrics.update(self.engine, outputs)
            self.metrics.priorities.step(self.engine, outputs, self.leases)
        clock.charge(LoopPart.CONTROL)

    def _before_engine(self) -> None:
        """What a step does before the engine's: the writer's reports, lost and cancelled jobs, deadlines, a pull."""
        clock = self.clock
        self._retire()
        clock.charge(LoopPart.REPORTS)
        self._take_pulled()
        clock.charge(LoopPart.PULL)
        is_holding = bool(self.leases)
        if is_holding:
            self._drop(self._lost_jobs())
        self._time_out(self.deadlines.past())
        if not self._puller_pulls() and self._may_pull():
            clock.charge(LoopPart.CONTROL)
            self._pull()
            clock.charge(LoopPart.PULL)
            self._puller_pulls()  # with the room that pull left
        if not is_holding:  # nothing to drop before the pull: it goes first (a new job's start waits less)
            self._drop(self._lost_jobs())  # a job cancelled as it was pulled is dropped before its first step
        clock.charge(LoopPart.CONTROL)

    def _take_pulled(self, wait: bool = False) -> None:
        """Admit the jobs the puller started since the last boundary; a stopping worker waits for a pull in
        flight and hands them back. A pull Redis refused (its script or streams lost) makes the loop pull."""
        if self.puller is None:
            return
        replies, self._pull_in_flight = self.puller.take(wait=wait or self.is_stopping)
        for call, reply in replies:
            leases = self.reader.read_pulled(call, reply)
            if leases is None:  # the loop's own pull, at once, loads the script or makes the groups again
                self._jobs_queued = set(Priority)
                self._pull_refused = True
            elif self.is_stopping:
                self._hand_back(leases)
            else:
                if self.metrics is not None:
                    self.metrics.jobs_pulled("puller", len(leases))
                for lease in leases:
                    self._admit(lease)
        if not self._pull_in_flight and self._announced_in_flight:  # read while a pull was in flight
            self._jobs_queued |= self.reader.unseen(self._announced_in_flight)
            self._announced_in_flight = {}

    def _puller_pulls(self) -> bool:
        """While the engine runs jobs and has room, the puller pulls, not the loop: armed with that room (at once
        for the jobs the loop knows to wait) until a later boundary; one pull in flight, it stays as it was. The
        loop's own pull goes when a reclaim is due, or to preempt (a full engine)."""
        if self.puller is not None and not self.running:
            self.puller.rest()  # nothing to step: the idle wait pulls (Puller.rest)
        if self.puller is None or not self.running or self.is_stopping or self._pull_refused:
            return False
        if not self.puller.is_alive():  # it failed (logged): the loop's own pulls from now on
            return False
        if self._pull_in_flight:
            return True
        room = self.engine.room_after_waiting()  # the jobs admitted at this boundary count as started
        call = self.reader.pull_call()
        is_reclaim_due = time.monotonic() - self._last_pull_s >= self.settings.reclaim_interval_s
        if room <= 0 or call is None or is_reclaim_due:
            return False
        pull_now = bool(self._jobs_queued) or any(self.reader.waiting.values())
        self.puller.arm(call, room, pull_now)
        self._jobs_queued = set()
        return True

    def _hand_back(self, leases: list[Lease]) -> None:
        for lease in leases:
            log.info("handing job %s back: %s", lease.job_id, self.reader.hand_back(lease))

    def _retire(self) -> None:
        """The writer's reports: forget jobs whose final write landed, drop jobs that are no longer ours. While
        the engine runs jobs they are taken every `_reports_interval_s` only (module docstring: "Reports")."""
        if self.running and not self.is_stopping and self.clock.last_charge_s < self._next_reports_s:
            return
        self._next_reports_s = self.clock.last_charge_s + self._reports_interval_s
        wait_s = RETIRE_WAIT_S if not self.running and self.writer.num_unsettled else 0.0
        reports = self.writer.take_reports(wait_s)
        if self.metrics is not None:
            self.metrics.token_events_written(self.writer.num_token_events)
        for report in reports:
            if not (report.ended or report.gone):  # most steps: nothing ended
                continue
            if self.metrics is not None:
                for _ in self._timed_out.intersection(report.ended):  # its `timeout` failure landed
                    self.metrics.job_finished(JobOutcome.DEADLINE_EXCEEDED)
            self._forget(report.ended)
            self._drop(report.gone)

    def _may_pull(self) -> bool:
        """Room in the engine (free, or held by less urgent jobs it would preempt for a waiting one), and a
        job may be waiting (cheap: no Redis call when no pull is due)."""
        if self.is_stopping:
            self.num_pulled_last = 0
            return False
        if self.engine.free_capacity() <= 0:  # full: worth a pull only for a queue that would preempt
            urgent = self._preempting_priorities()
            if any(p in self._jobs_queued or self.reader.waiting[p] for p in urgent):
                return True
            self.num_pulled_last = 0
            return False
        is_due = time.monotonic() - self._last_pull_s >= self.settings.reclaim_interval_s
        if self.burst or self._jobs_queued or is_due or any(self.reader.waiting.values()):
            return True
        self.num_pulled_last = 0
        return False

    def _preempting_priorities(self) -> dict[Priority, int]:
        """Queues whose jobs the full engine would start now by preempting less urgent ones -> how many."""
        room = {p: self.engine.free_capacity_for(engine_priority(p)) for p in Priority}
        return {p: n for p, n in room.items() if n > 0}

    def _pull(self) -> None:
        self._last_pull_s = time.monotonic()
        self._pull_refused = False
        free = self.engine.free_capacity()
        if free > 0:
            self._jobs_queued = set()
            leases = self.reader.pull(free)
        else:  # a full engine takes only jobs it would preempt for; as many as the least urgent of them may
            urgent = self._preempting_priorities()
            leases = self.reader.pull(min(urgent.values()), list(urgent))
            self._jobs_queued -= urgent.keys()
        self._admit_pulled(leases)

    def _wait_and_pull(self) -> None:
        """Idle: block on the queues, the pull riding the same round trip where the reader can
        (QueueReader.wait_and_pull); its jobs are admitted here, so the next step starts them without a pull,
        and before anything else: held nothing before, the worker has no report to take, no deadline due, and its
        control channel holds the announcement of the jobs it just pulled, which redis-py reads in ~0.1 ms (caches
        cold) on the way to each new job's first token. The next step reads it: a job cancelled as it was pulled
        runs that one step, whose write the STEP script refuses (the job is no longer this attempt's), and is
        dropped then. A stop requested meanwhile hands them straight back. (The puller is armed only while the
        engine runs jobs: a pull of its still in flight at the last boundary is waited for and taken first.)"""
        num_held = len(self.leases)
        self._take_pulled(wait=True)
        if len(self.leases) > num_held:  # not idle after all: the next step runs them
            return
        leases = self.reader.wait_and_pull(self.settings.idle_block_ms, self.engine.free_capacity())
        if leases is None:  # it only waited: the next step pulls
            self._jobs_queued = set(Priority)
            return
        self._last_pull_s = time.monotonic()
        self._jobs_queued = set()
        if self.is_stopping:
            self._hand_back(leases)
            leases = []
        self._admit_pulled(leases)
        self._woken_with_jobs = bool(self.running)

    def _admit_pulled(self, leases: list[Lease]) -> None:
        """A pull's jobs into the engine (`num_pulled_last` counts them)."""
        self.num_pulled_last = len(leases)
        if self.metrics is not None:
            self.metrics.jobs_pulled("loop", len(leases))
        for lease in leases:
            self._admit(lease)

    def _emit(self, outputs: list[StepOutput]) -> None:
        """Hand this step's writes to the writer; a job the engine finished leaves `running` (its KV is free)
        but stays held until its final write landed."""
        step, self._pending = self._pending, StepWrite(self.epoch)
        writes = step.writes + self.emitter.writes_for(self.running, outputs)
        notices = self.hooks.on_output(outputs)  # an `output` webhook reads the output: its job's tokens go now
        step.writes = self.hold.take(writes, time.monotonic(), frozenset(job_id for job_id, _ in notices))
        step.output_notices += notices
        for out in outputs:
            if out.finished:
                self.running.pop(out.request_id, None)
        step.engine_idle = not self.running
        self.writer.submit(step)

    def run(self) -> None:
        self.start()
        self.clock.restart()
        try:
            while not self._should_exit():
                try:
                    self.step()
                    if self._is_idle():
                        with self.clock.idling():
                            self._wait_and_pull()
                except redis.RedisError as exc:
                    self._on_redis_error(exc)
                    self.clock.charge(LoopPart.CONTROL)
        finally:
            self.shutdown()

    def _on_redis_error(self, exc: redis.RedisError) -> None:
        """Redis is unreachable (here or in the writer process): what was generated since the last write cannot be
        recorded, so drop every held job (its KV is freed) and every write not sent yet; once Redis answers again
        its entry is reclaimed (by this worker or another) and resumed from the last token written. Then back
        off."""
        log.warning(
            "redis error (%s): dropping %d held jobs; retrying in %.1fs", exc, len(self.leases), REDIS_RETRY_S
        )
        self._drop(list(self.leases))
        self.writer.discard(self.epoch)
        self.epoch += 1
        self._pending = StepWrite(self.epoch)
        self._jobs_queued = set(Priority)
        time.sleep(REDIS_RETRY_S)

    def _is_idle(self) -> bool:
        """Nothing held and the last pull found nothing: block on the queues instead of spinning."""
        return not self.leases and self.num_pulled_last == 0 and not self.is_stopping and not self.burst

    def _should_exit(self) -> bool:
        if self.is_stopping:
            assert self.stop_deadline is not None
            return not self.leases or time.monotonic() >= self.stop_deadline
        if self._pull_in_flight:  # the puller's jobs come first (the next steps take them)
            return False
        return self.burst and not self.leases and self.num_pulled_last == 0 and self._nothing_waiting()

    def _nothing_waiting(self) -> bool:
        return not any(self.reader.waiting.values())

    # -- lifecycle ---------------------------------------------------------------------------------------
    def start(self) -> None:
        self._wait_for_redis()
        self._control.subscribe()
        if self.settings.warm_up:
            self.warmup = warm_up(self.engine)  # before the first heartbeat: /readyz is ready only after it
        if self.on_started is not None:
            self.on_started()
        # the writer process before the first heartbeat: /readyz turns ready once a job would start at once (its
        # start and pacing probe took ~0.4 s, in which a job submitted to a worker marked ready waited queued)
        self.writer.start()
        if self.puller is not None:
            self.puller.subscribe()
            self.puller.start()
        self.redis.hset(keys.WORKER_VERSIONS, self.worker_id, self.settings.model_version)  # GET /v1/models
        self.heartbeat.beat()
        self.heartbeat.start()
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._on_signal)
            signal.signal(signal.SIGINT, self._on_signal)
        log.info("worker %s ready (model version %s, max_model_len %d)", self.worker_id,
                 self.settings.model_version, self.engine.max_model_len)

    def _wait_for_redis(self) -> None:
        """The first Redis call (the queues' consumer groups), retried until Redis answers: a worker started before
        its Redis (or while it restarts) waits for it, as Celery does, instead of exiting once its models loaded.
        A stop requested meanwhile raises the last error."""
        retry_s = REDIS_RETRY_S
        while True:
            try:
                self.reader.ensure_groups()
                return
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                if self.is_stopping:
                    raise
                log.warning("redis is unreachable (%s); retrying in %.0fs", exc, retry_s)
                time.sleep(retry_s)
                retry_s = min(2 * retry_s, START_RETRY_MAX_S)

    def request_stop(self, grace_s: float | None = None) -> None:
        if not self.is_stopping:
            grace = self.settings.shutdown_grace_s if grace_s is None else grace_s
            self.stop_deadline = time.monotonic() + grace
            log.info(
                "worker %s stopping: %d jobs held, %.1fs to finish them",
                self.worker_id,
                len(self.leases),
                grace,
            )

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.request_stop()

    def shutdown(self) -> None:
        """Land what the writer holds, hand every unfinished job back to its queue, then unregister."""
        if self.puller is not None:  # what it started since the last boundary goes back with the rest
            self.puller.stop()
            try:
                replies, _ = self.puller.take(wait=True)
                self._hand_back([lease for call, reply in replies
                                 for lease in self.reader.read_pulled(call, reply) or []])  # fmt: skip
            except redis.RedisError as exc:  # its jobs are reclaimed after claim_timeout_s instead
                log.warning("could not hand back what the puller started: %s", exc)
        try:
            self._pending.epoch = self.epoch
            self._pending.writes = self.hold.flush() + self._pending.writes  # held tokens land before a handback
            self.writer.submit(self._pending)
            for report in self.writer.drain(DRAIN_TIMEOUT_S):
                self._forget(report.ended)
                self._drop(report.gone)
        except redis.RedisError as exc:  # what was not written is resumed from the last token that was
            log.warning("could not write the last steps: %s", exc)
        self.writer.stop()
        for lease in self.held_leases():
            self.engine.abort(lease.job_id)
            try:
                log.info("handing job %s back: %s", lease.job_id, self.reader.hand_back(lease))
            except redis.RedisError as exc:  # it is reclaimed after claim_timeout_s instead
                log.warning("could not hand job %s back: %s", lease.job_id, exc)
        self._forget(list(self.leases))
        self.heartbeat.stop()
        try:
            self.redis.hdel(keys.WORKER_VERSIONS, self.worker_id)
        except redis.RedisError as exc:
            log.warning("could not unregister worker %s's version: %s", self.worker_id, exc)
        self._control.close()
        self.reader.close()

    # -- per job -------------------------------------------------------------------------------------------
    def _admit(self, lease: Lease) -> None:
        with logs.bound(job_id=lease.job_id):
            self._admit_job(lease)

    def _admit_job(self, lease: Lease) -> None:
        request = lease.request
        with self._leases_lock:
            self.leases[lease.job_id] = lease
        if isinstance(request, StoredRequestError):  # it does not validate here: the job fails, the worker goes on
            log.warning("job %s: %s", lease.job_id, request.message)
            self._fail(lease, ErrorCode.INVALID_REQUEST, request.message, request.field)
            return
        if self.metrics is not None and lease.attempt == 1 and lease.clock is not None:
            self.metrics.priorities.job_started(lease.priority, lease.clock.started_at - lease.clock.created_at)
        if self.deadlines.track(lease.job_id, request, lease.clock) <= 0:
            self._time_out([lease.job_id])  # pulled already past its deadline: no engine step for it
            return
        self._pending.start_notices += self.hooks.on_start(lease.job_id, request)
        num_resumed = len(lease.resumed_token_ids)
        remaining = request.max_tokens - num_resumed
        try:
            prompt = engine_prompt(request, self.engine.tokenizer, lease.resumed_token_ids)
            if remaining <= 0:
                num_prompt = len(prompt) - num_resumed if isinstance(prompt, list) else 0
                # a resumed job that already has all its tokens finishes without an engine step
                self._pending.writes.append(
                    JobWrite(
                        job_id=lease.job_id,
                        attempt=lease.attempt,
                        prompt_tokens=num_prompt,
                        completion_tokens=num_resumed,
                        finish_reason="length",
                        is_finished=True,
                    )
                )
                return
            params = self.params_factory(request, remaining)
            params.num_resumed_tokens = num_resumed  # a grammar continues after the output it resumes
            num_prompt = self.engine.add_request(lease.job_id, prompt, params, engine_priority(lease.priority))
        except PromptTooLongError as exc:
            self._fail(lease, ErrorCode.PROMPT_TOO_LONG, exc.message, exc.field)
        except InvalidRequestError as exc:  # the engine names its `prompt`: a request's token ids are their own field
            field_name = "prompt_token_ids" if exc.field == "prompt" and request.prompt_token_ids else exc.field
            self._fail(lease, ErrorCode.INVALID_REQUEST, exc.message, field_name)
        except Exception as exc:  # a job the engine cannot take fails alone; the worker goes on
            log.exception("engine refused job %s", lease.job_id)
            self._fail(lease, ErrorCode.ENGINE_ERROR, f"{type(exc).__name__}: {exc}", None)
        else:
            self.running[lease.job_id] = Running(
                lease.job_id,
                lease.attempt,
                num_prompt - num_resumed,
                num_resumed,
                logprobs=self._job_logprobs(lease, num_prompt - num_resumed),
                wants_token_logprobs=request.logprobs is not None,
            )
            interval_ms = request.stream_interval_ms
            if interval_ms is None:
                interval_ms = self.settings.stream_interval_ms.for_priority(lease.priority)
            self.hold.track(lease.job_id, interval_ms / 1e3)
            log.debug("started job %s attempt %d (%d prompt tokens)", lease.job_id, lease.attempt, num_prompt)

    def _job_logprobs(self, lease: Lease, num_prompt_tokens: int) -> JobLogprobs | None:
        """The job's logprobs keeper, when its request asks for any (workers/worker/logprobs.py)."""
        request = lease.request
        if isinstance(request, StoredRequestError) or (request.logprobs is None and request.prompt_logprobs is None):
            return None
        return JobLogprobs(self.token_texts, num_prompt_tokens, bool(lease.resumed_token_ids))

    def _fail(self, lease: Lease, code: ErrorCode, message: str, field_name: str | None) -> None:
        """Fail a job the engine refused: written with this step's writes, retired once that landed."""
        if self.metrics is not None:
            self.metrics.job_finished(JobOutcome.FAILED)
        failure = JobFailure(code, message, field_name)
        self._pending.writes.append(self.emitter.failure(lease.job_id, lease.attempt, failure))

    def _time_out(self, job_ids: list[str]) -> None:
        """Stop jobs past their execution deadline: failed `timeout`, their output so far kept. The failure is
        written with this step's writes (after the job's earlier tokens) and counted once it landed (not for
        a job cancelled or taken over meanwhile: see _retire)."""
        message = "the job ran past its execution deadline (timeout_s / Cancel-After / job_timeout_s)"
        for job_id in job_ids:
            lease = self.leases[job_id]
            if self.running.pop(job_id, None) is not None:
                self.engine.abort(job_id)
            compute_s, cost = self.costs.take(job_id)  # the record keeps what the job ran up, as a success's does
            failure = JobFailure(ErrorCode.TIMEOUT, message, metrics={"compute_s": compute_s, "cost": cost})
            self._pending.writes.append(self.emitter.failure(job_id, lease.attempt, failure))
            self._timed_out.add(job_id)
            self.deadlines.forget([job_id])
            if self.metrics is not None:
                self.metrics.job_cost(compute_s, cost)
            log.info("job %s stopped at its deadline", job_id, extra={"job_id": job_id})

    def _account(self, step_s: float, outputs: list[StepOutput]) -> None:
        """Charge the step's engine time to its jobs; finished ones carry compute_s and cost in their metrics."""
        self.costs.account(step_s, scheduled_tokens(self.engine))
        for compute_s, cost in self.costs.finished(outputs):
            if self.metrics is not None:
                self.metrics.job_cost(compute_s, cost)

    def _lost_jobs(self) -> set[str]:
        """Jobs in the engine cancelled (control channel) or found lost by the heartbeat; notes a newly queued job
        on the way. A held job out of the engine has a write on its way (its end, a failure) whose report retires
        or drops it: a job that just ended is `gone` to the heartbeat's script, and is no lost job."""
        lost = self.heartbeat.take_lost()
        try:
            messages = self._control.take()
            if self._pull_in_flight:  # its reply may start them: weighed once it is read (_take_pulled)
                held = ControlMessages(queued=self._announced_in_flight)
                held.add_queued(messages.queued)
                self._announced_in_flight = held.queued
            else:
                self._jobs_queued |= self.reader.unseen(messages.queued)  # not those the last pull saw
            lost |= messages.cancelled
        except redis.RedisError as exc:  # the STEP script's status check still catches every cancel
            log.warning("control channel: %s", exc)
            self._jobs_queued = set(Priority)
        return lost & self.running.keys()

    def _drop(self, job_ids: list[str] | set[str]) -> None:
        """Stop jobs that are no longer ours (cancelled, reclaimed): free their KV now."""
        for job_id in job_ids:
            if job_id in self.running:
                self.engine.abort(job_id)
            log.info("dropped job %s (cancelled or taken over)", job_id, extra={"job_id": job_id})
        self._forget(list(job_ids))

    def _forget(self, job_ids: list[str]) -> None:
        self.hooks.forget(job_ids)
        self.hold.forget(job_ids)
        self.deadlines.forget(job_ids)
        self.costs.forget(job_ids)
        self._timed_out.difference_update(job_ids)
        with self._leases_lock:
            for job_id in job_ids:
                self.leases.pop(job_id, None)
                self.running.pop(job_id, None)
