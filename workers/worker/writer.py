"""The worker loop's handle on its writer process (workers/worker/writer_process.py): step N's outputs are
written while step N+1 computes, with no Redis call and no other Python thread in the loop's process.

    loop:     engine.step() -> writer.submit(StepWrite): one pickle of plain tuples into a socket -> the next step
    process:  the StepWrites so far -> ONE pipeline -> Settled (a Report, or the RedisError that failed it)
    loop:     before the next step, ONE non-blocking recv takes every Settled that came back (child_process.Channel)

- Backpressure: submit() waits for the writer once the oldest step not yet settled was handed over more than
  `settings.writer_max_lag_ms` ago, or `max_pending` steps are unsettled. A bound in time, not in steps: a
  writer whose round trip takes several of a fast engine's steps (a small model; a GPU) is let behind by that
  much, and takes the steps that came meanwhile in one pipeline (their tokens of a job as one event); with a
  bound of 3 steps, the loop waited for it instead, at every step (`bench e2e --model tiny`, README). What a
  crash loses is the same either way: the jobs resume from the last token written.
- Pacing: start() measures what waking the writer costs this loop's send (writer_pacing.choose) and tells it
  whether to pace its waits; a step that leaves the engine empty says so (StepWrite.engine_idle), and after a
  step that must not wait for a pacing writer's next look (StepWrite.is_urgent) submit() rings its doorbell.
- Retiring: a job that ended is forgotten by the loop only when a Report says its final write landed
  (FINISH acks its queue entry atomically with that write).
- Failure: a RedisError is raised in the loop by the next take_reports(), once. The loop then drops every
  job it holds (they resume from the last token written) and discards the failed epoch: every write queued
  before that is skipped, so no later write of a job ever lands after an earlier one that failed (no gap,
  no duplicate). A writer process that died counts as such a failure, and discard() starts a new one.
"""

import logging
import socket
import subprocess
import time
from collections import deque

import redis

from shared import cpu_placement
from shared.settings import ServiceSettings
from workers.child_process import Channel, spawn_connected
from workers.worker.writer_pacing import PacingChoice, choose
from workers.worker.writer_process import PROBED, READY, Discard, Pace, Probe, Report, Settled, StepWrite

log = logging.getLogger(__name__)

MAX_PENDING_STEPS = 64  # steps written or waiting to be, at most, however young (the pipe's memory)
START_TIMEOUT_S = 60.0  # for the writer process to import, connect and say it is ready
STOP_TIMEOUT_S = 10.0  # for it to exit after the last step

__all__ = ["Report", "StepWrite", "StepWriter"]


class StepWriter:
    def __init__(
        self, settings: ServiceSettings, max_pending: int = MAX_PENDING_STEPS, io_cpus: frozenset[int] = frozenset()
    ) -> None:
        if settings.redis_url is None:
            raise ValueError("the worker's writer needs settings.redis_url")
        self.settings = settings
        self.max_pending = max_pending
        self.max_lag_s = settings.writer_max_lag_ms / 1e3
        self.io_cpus = io_cpus  # the process runs there (shared/cpu_placement.py); empty: anywhere
        self._conn: Channel | None = None
        self._bell: socket.socket | None = None  # rung after a step that must not wait (StepWrite.is_urgent)
        self._process: subprocess.Popen[bytes] | None = None
        self._reports: list[Report] = []
        self._error: redis.RedisError | None = None
        self._error_epoch = -1
        self._last_epoch = -1  # of the newest step submitted
        self._is_dead = False  # the process exited unasked: discard() starts a new one
        self._handed_s: deque[float] = deque()  # when each unsettled step was handed over (monotonic), oldest first
        self.num_round_trips = 0  # pipelines executed (tests count them)
        self.num_token_events = 0  # token events written so far (the writer's reports; metrics read it)
        self.pacing: PacingChoice | None = None  # how the writer waits for steps (measured at start)

    # -- lifecycle ----------------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the writer process and wait until it is connected (before the worker takes a job)."""
        bell, their_bell = socket.socketpair()  # the doorbell: steps that must not wait for a pacing writer's look
        try:
            self._process, conn = spawn_connected(
                lambda fd: ["-c", f"from workers.worker.writer_process import main; main({fd}, {their_bell.fileno()})"],
                extra_fds=(their_bell.fileno(),),
            )
        except OSError:
            bell.close()
            raise
        finally:
            their_bell.close()  # the child holds its own copy
        bell.setblocking(False)
        self._bell = bell
        self._conn = Channel.of(conn)
        cpu_placement.bind(self.io_cpus, self._process.pid)  # one thread, all its life: binding it binds the process
        try:
            self._conn.send(self.settings)
            is_ready = self._conn.read(START_TIMEOUT_S) == [READY]
        except (EOFError, OSError):
            is_ready = False
        if not is_ready:
            self.stop()
            raise RuntimeError("the worker's writer process did not start (its error is in this log)")
        if self.pacing is None:  # measured once: a replaced writer process paces as its first did
            self.pacing = choose(self.settings.writer_pacing, self._send_us)
            log.info("writer %s", self.pacing.describe())
        self._conn.send(Pace(self.pacing.is_on))

    def _send_us(self, probe_sleep_s: float, wait_s: float) -> float:
        """One probe: microseconds this process's send of it took, `wait_s` after the last answer (the writer then
        blocked on the pipe, or asleep away from it for `probe_sleep_s`); its answer read before returning."""
        assert self._conn is not None
        time.sleep(wait_s)
        start_s = time.perf_counter()
        self._conn.send(Probe(probe_sleep_s))
        send_us = (time.perf_counter() - start_s) * 1e6
        if self._conn.read(START_TIMEOUT_S) != [PROBED]:
            raise RuntimeError("the worker's writer process did not answer its probe")
        return send_us

    def stop(self) -> None:
        """Let the process write what it holds and exit (kill it after STOP_TIMEOUT_S)."""
        if self._process is None or self._conn is None:
            return
        try:
            self._conn.send(None)
        except OSError:  # it is gone already
            pass
        try:
            self._process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            log.warning("the writer process did not exit; killing it")
            self._process.kill()
            self._process.wait()
        self._conn.close()
        self._conn = self._process = None
        if self._bell is not None:
            self._bell.close()
            self._bell = None

    # -- loop side ----------------------------------------------------------------------------------------
    def submit(self, step: StepWrite) -> None:
        if step.is_empty:
            return
        if self._conn is None or self._is_dead:  # not started, or not restarted yet: the write is lost
            self._on_dead()
            return
        while self._is_behind() and self._error is None:  # the writer answers its oldest steps first
            self._receive(None)
        if self._error is not None:  # the loop drops this epoch's jobs at its next take_reports()
            return
        try:
            self._conn.send(step.wire())
        except OSError:
            self._on_dead()
            return
        if self._bell is not None and self.pacing is not None and self.pacing.is_on and step.is_urgent:
            try:
                self._bell.send(b"\0")
            except OSError:  # full (a ring is pending already), or the writer is gone: the next read finds out
                pass
        self._handed_s.append(time.monotonic())
        self._last_epoch = max(self._last_epoch, step.epoch)

    @property
    def num_unsettled(self) -> int:
        """Steps submitted and not settled yet."""
        return len(self._handed_s)

    def _is_behind(self) -> bool:
        """The writer is too far behind for another step: `max_pending` unsettled, or the oldest one too old."""
        if self.num_unsettled >= self.max_pending:
            return True
        return bool(self._handed_s) and time.monotonic() - self._handed_s[0] > self.max_lag_s

    def take_reports(self, wait_s: float = 0.0) -> list[Report]:
        """The reports so far (waiting up to `wait_s` for one while writes are pending); raises the writer's
        RedisError, once."""
        waits = wait_s > 0 and not self._reports and self._error is None and self.num_unsettled
        self._receive(wait_s if waits else 0.0)
        if self._error is not None:
            exc, self._error = self._error, None
            raise exc
        reports, self._reports = self._reports, []
        return reports

    def drain(self, timeout_s: float) -> list[Report]:
        """Wait until every submitted step was written (or failed, raised here), up to `timeout_s`."""
        deadline_s = time.monotonic() + timeout_s
        while self.num_unsettled and self._error is None and (left_s := deadline_s - time.monotonic()) > 0:
            self._receive(left_s)
        return self.take_reports()

    def discard(self, epoch: int) -> None:
        """The loop dropped every job of `epoch`: skip that epoch's writes still queued, forget its error; a
        writer process that died is replaced."""
        if self._conn is not None and not self._is_dead:
            try:
                self._conn.send(Discard(epoch))
            except OSError:
                self._on_dead()
        if self._error is not None and self._error_epoch <= epoch:
            self._error = None
        if self._is_dead:
            self.stop()
            try:
                self.start()
            except (OSError, RuntimeError) as exc:  # the loop backs off and discards again on the next failure
                log.error("could not restart the writer process: %s", exc)
                return
            self._is_dead = False

    # -- answers ----------------------------------------------------------------------------------------------
    def _receive(self, timeout_s: float | None) -> None:
        """Take every answer the process sent, waiting up to `timeout_s` (None: no limit) for the first."""
        if self._conn is None:
            return
        try:
            answers = self._conn.read(timeout_s)
        except (EOFError, OSError):
            self._on_dead()
            return
        for answer in answers:
            self._settle(Settled.of_wire(answer))

    def _settle(self, settled: Settled) -> None:
        for _ in range(min(settled.num_steps, len(self._handed_s))):
            self._handed_s.popleft()
        self.num_round_trips += settled.num_round_trips
        self.num_token_events += settled.num_token_events
        for warning in settled.warnings:
            log.warning("%s", warning)
        if settled.error is not None:
            log.warning("writing %d steps failed: %s", settled.num_steps, settled.error)
            self._error, self._error_epoch = settled.error, settled.error_epoch
        elif settled.report is not None:
            self._reports.append(settled.report)

    def _on_dead(self) -> None:
        """The process exited unasked: what it held may not have landed; the loop treats it as a Redis failure."""
        exitcode = self._process.poll() if self._process is not None else None
        if not self._is_dead:
            log.warning("the writer process exited (code %s) with %d steps unwritten", exitcode, self.num_unsettled)
        self._error = redis.ConnectionError(f"the writer process exited (code {exitcode})")
        self._error_epoch = self._last_epoch
        self._handed_s.clear()
        self._is_dead = True
