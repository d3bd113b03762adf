"""The worker's Redis writes, on a thread of their own: step N's outputs are written while step N+1 computes.

    loop thread:   engine.step() -> writer.submit(StepWrite) -> the next step
    writer thread: the StepWrites queued so far -> ONE pipeline: start notices, ONE STEP script call (every
                   job's tokens and finishes, in step order), output notices -> a Report for the loop

- Order: one thread reading one FIFO queue, so a job's writes land in the order of its steps.
- Backpressure: at most `max_pending` steps wait; submit() blocks when Redis falls that far behind.
- Retiring: a job that ended is forgotten by the loop only when the Report says its final write landed
  (FINISH acks its queue entry atomically with that write).
- Failure: a RedisError is raised in the loop thread by the next take_reports(). The loop then drops every
  job it holds (they resume from the last token written) and discards the failed epoch: every write queued
  before that is skipped, so no later write of a job ever lands after an earlier one that failed (no gap,
  no duplicate).
"""

import logging
import queue
import threading
import time
from dataclasses import dataclass, field

import redis
from redis.exceptions import NoScriptError

from shared import redis_url as redis_urls
from workers.worker.emitter import Emitter, JobWrite
from workers.worker.job_hooks import JobHooks, Notice

log = logging.getLogger(__name__)

MAX_PENDING_STEPS = 2  # steps written or waiting to be; the loop blocks on a third


@dataclass
class StepWrite:
    """What one loop step hands the writer."""

    epoch: int  # the loop's Redis epoch: writes of an epoch that failed are discarded
    writes: list[JobWrite] = field(default_factory=list)  # in step order
    start_notices: list[Notice] = field(default_factory=list)  # webhook `start` (before the tokens)
    output_notices: list[Notice] = field(default_factory=list)  # webhook `output` (after the tokens)

    @property
    def is_empty(self) -> bool:
        return not (self.writes or self.start_notices or self.output_notices)


@dataclass
class Report:
    """What landed: jobs whose final write is in Redis, jobs that are no longer this worker's."""

    ended: list[str]
    gone: list[str]


class StepWriter(threading.Thread):
    def __init__(
        self, client: redis.Redis, emitter: Emitter, hooks: JobHooks, max_pending: int = MAX_PENDING_STEPS
    ) -> None:
        super().__init__(name="step-writer", daemon=True)
        self.redis = client
        self.emitter = emitter
        self.hooks = hooks
        self._queue: queue.Queue[StepWrite | None] = queue.Queue(maxsize=max_pending)
        self._cond = threading.Condition()
        self._reports: list[Report] = []
        self._error: redis.RedisError | None = None
        self._error_epoch = -1
        self._dead_epoch = -1  # writes of this epoch and older are skipped
        self.num_unsettled = 0  # steps submitted and not reported yet
        self.num_round_trips = 0  # pipelines executed (tests count them)

    # -- loop thread --------------------------------------------------------------------------------------
    def submit(self, step: StepWrite) -> None:
        if step.is_empty:
            return
        with self._cond:
            self.num_unsettled += 1
        self._queue.put(step)

    def take_reports(self, wait_s: float = 0.0) -> list[Report]:
        """The reports so far (waiting up to `wait_s` for one while writes are pending); raises the writer's
        RedisError, once."""
        with self._cond:
            if wait_s > 0 and not self._reports and self._error is None and self.num_unsettled:
                self._cond.wait(wait_s)
            if self._error is not None:
                exc, self._error = self._error, None
                raise exc
            reports, self._reports = self._reports, []
        return reports

    def drain(self, timeout_s: float) -> list[Report]:
        """Wait until every submitted step was written (or failed, raised here), up to `timeout_s`."""
        deadline_s = time.monotonic() + timeout_s
        with self._cond:
            while self.num_unsettled and self._error is None and (left_s := deadline_s - time.monotonic()) > 0:
                self._cond.wait(left_s)
        return self.take_reports()

    def discard(self, epoch: int) -> None:
        """The loop dropped every job of `epoch`: skip that epoch's writes still queued, forget its error."""
        with self._cond:
            self._dead_epoch = max(self._dead_epoch, epoch)
            if self._error is not None and self._error_epoch <= epoch:
                self._error = None

    def stop(self) -> None:
        self._queue.put(None)
        if self.is_alive():
            self.join()

    # -- writer thread ------------------------------------------------------------------------------------
    def run(self) -> None:
        while True:
            batch, is_last = self._next_batch()
            if batch:
                self._write_batch(batch)
            if is_last:
                return

    def _next_batch(self) -> tuple[list[StepWrite], bool]:
        """Block for one step, then take every step already queued behind it (one pipeline for all)."""
        steps: list[StepWrite] = []
        item = self._queue.get()
        while item is not None:
            steps.append(item)
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return steps, False
        return steps, True

    def _write_batch(self, steps: list[StepWrite]) -> None:
        live = [s for s in steps if s.epoch > self._dead_epoch]
        try:
            report = self._write(live) if live else Report([], [])
        except redis.RedisError as exc:
            log.warning("writing %d steps failed: %s", len(live), exc)
            with self._cond:
                epoch = max(s.epoch for s in live)
                self._dead_epoch = max(self._dead_epoch, epoch)
                self._error, self._error_epoch = exc, epoch
                self.num_unsettled -= len(steps)
                self._cond.notify_all()
            return
        with self._cond:
            self._reports.append(report)
            self.num_unsettled -= len(steps)
            self._cond.notify_all()

    def _write(self, steps: list[StepWrite]) -> Report:
        pipe = redis_urls.pipeline(self.redis, transaction=False)
        starts = [n for s in steps for n in s.start_notices]
        self.hooks.queue(pipe, starts)
        call_keys, args, calls = self.emitter.step_call([w for s in steps for w in s.writes])
        if calls:
            pipe.evalsha(self.emitter.step_sha, len(call_keys), *call_keys, *args)
        self.hooks.queue(pipe, [n for s in steps for n in s.output_notices])
        replies = pipe.execute(raise_on_error=False)
        self.num_round_trips += 1
        for reply in replies[: len(starts)] + replies[len(starts) + (1 if calls else 0) :]:
            if isinstance(reply, Exception):  # a lost start/output notice never stops a job
                log.warning("webhook notice not written: %s", reply)
        if not calls:
            return Report([], [])
        step_reply = replies[len(starts)]
        if isinstance(step_reply, NoScriptError):  # a restarted Redis: nothing of the step ran, send it again
            self.emitter.load_script()
            step_reply = self.redis.evalsha(self.emitter.step_sha, len(call_keys), *call_keys, *args)
        if isinstance(step_reply, Exception):
            raise step_reply
        return Report(*self.emitter.settle(calls, list(step_reply)))

