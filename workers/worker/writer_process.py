"""The worker's writer process: it lands the loop's StepWrites in Redis while the loop's next steps compute.

    loop (worker process):  engine.step() -> StepWrite -> socket (one pickle of tuples, no Redis, no thread to wake)
    this process:           the StepWrites in the pipe so far -> ONE pipeline: per partition, start notices, ONE
                            STEP script call (every job's tokens and finishes, in step order; a job's tokens
                            of several steps as one event: stream_interval.coalesce), output notices
                            -> Settled (on a Cluster one pipeline per node that owns a partition)

A process, not a thread: a writer thread takes the loop's GIL for every step's serialisation, round trip and
reply. With one engine and a real Redis in one process (interleaved rounds, 2026-12-01), a writer thread left
the engine 0.82x its own tokens/s at 16 closed-loop clients and 0.92x at one; this process 0.95x and 0.98x.

- Order: one process reading one FIFO pipe, so a job's writes land in the order of its steps.
- Epochs: the loop bumps its epoch after a Redis failure and sends Discard(dead epoch); the steps of a dead
  epoch taken in the same batch as (or after) it are skipped, never written, as a thread writer skips the
  ones still queued. A batch that fails makes its own epoch dead here at once, so no later write of a job
  lands after an earlier one that failed.
- Start: `main(FD, BELL_FD)` in a fresh interpreter (workers/worker/writer.py), FD its end of a socket pair with
  the loop (a child_process.Channel at both ends: pickled messages, each framed by its length, every message
  that arrived taken with one recv), BELL_FD its end of the doorbell; it takes the settings from FD, says READY.
- Waits: blocked on the pipe, or, while steps come one after another and the loop said Pace(on), asleep on the
  doorbell until the next step is due and then a look each poll interval (writer_pacing.py): the loop's send
  then wakes nobody, and it rings the doorbell only after a step that must not wait (a job's first tokens or end).
  At start the loop's Probes time its sends to this process blocked and asleep (writer.py: the pacing choice).
- Signals: SIGINT and SIGTERM are ignored; the process ends on the loop's `None` (a clean stop, after the last
  steps were written) or when its connection closes (the worker died: what was not written is resumed).
- Logging: none here; warnings travel back in Settled and the loop logs them.
"""

import pickle
import select
import signal
import socket
import time
from dataclasses import dataclass, field
from typing import Any

import redis
from redis.cluster import RedisCluster
from redis.exceptions import NoScriptError

from shared import gc_pauses, keys
from shared import redis_url as redis_urls
from shared.settings import ServiceSettings
from workers.child_process import Channel
from workers.worker.emitter import Emitter, JobWrite
from workers.worker.job_hooks import JobHooks, Notice
from workers.worker.stream_interval import coalesce
from workers.worker.writer_pacing import Pacer

READY = "ready"  # the first message: connected, scripts registered
PROBED = "probed"  # the answer to a Probe
BELL_READ_BYTES = 4096  # rings taken at once from the doorbell


@dataclass
class StepWrite:
    """What one loop step hands the writer."""

    epoch: int  # the loop's Redis epoch: writes of an epoch that failed are discarded
    writes: list[JobWrite] = field(default_factory=list)  # in step order
    start_notices: list[Notice] = field(default_factory=list)  # webhook `start` (before the tokens)
    output_notices: list[Notice] = field(default_factory=list)  # webhook `output` (after the tokens)
    engine_idle: bool = False  # the engine holds no job after this step: the writer stops pacing (writer_pacing.py)

    @property
    def is_empty(self) -> bool:
        return not (self.writes or self.start_notices or self.output_notices)

    @property
    def is_urgent(self) -> bool:
        """A step a pacing writer must not leave for its next look (writer_pacing.py): it ends a job (the client's
        next request waits for that write, and the loop's retire for its answer), holds a job's first tokens (its
        TTFT), or leaves the engine empty. The loop rings the writer's doorbell after handing it over: a wake-up,
        paid for once or twice a job."""
        if self.engine_idle:
            return True
        return any(write.is_finished or write.completion_tokens == len(write.new_token_ids) for write in self.writes)

    def wire(self) -> tuple[Any, ...]:
        """Plain tuples for the pipe (JobWrite.wire says why)."""
        writes = tuple(write.wire() for write in self.writes)
        return self.epoch, writes, tuple(self.start_notices), tuple(self.output_notices), self.engine_idle

    @classmethod
    def of_wire(cls, wire: tuple[Any, ...]) -> "StepWrite":
        epoch, writes, start_notices, output_notices, engine_idle = wire
        return cls(epoch, [JobWrite.of_wire(w) for w in writes], list(start_notices), list(output_notices),
                   engine_idle)  # fmt: skip


@dataclass(frozen=True)
class Probe:
    """At start (writer.py: the pacing choice): answer PROBED at once, then sleep `sleep_s` away from the pipe."""

    sleep_s: float


@dataclass(frozen=True)
class Pace:
    """Pace the waits for steps (writer_pacing.py) or always block on the pipe."""

    is_on: bool


@dataclass(frozen=True)
class Discard:
    """The loop dropped every job of `epoch` and older: their steps not written yet are skipped."""

    epoch: int


@dataclass
class Report:
    """What landed: jobs whose final write is in Redis, jobs that are no longer this worker's."""

    ended: list[str]
    gone: list[str]


@dataclass
class Settled:
    """The writer's answer for `num_steps` StepWrites (one pipeline): a Report, or the error that failed it."""

    num_steps: int
    report: Report | None = None
    error: redis.RedisError | None = None  # the batch failed: its epoch (error_epoch) is dead
    error_epoch: int = -1
    num_round_trips: int = 0
    warnings: list[str] = field(default_factory=list)  # for the loop's log
    num_token_events: int = 0  # token events the batch wrote (its STEP calls' emits that landed)

    def wire(self) -> tuple[Any, ...]:
        """Plain tuples for the pipe: the loop reads one after every step it hands over."""
        report = (self.report.ended, self.report.gone) if self.report is not None else None
        return (self.num_steps, report, self.error, self.error_epoch, self.num_round_trips, self.warnings,
                self.num_token_events)  # fmt: skip

    @classmethod
    def of_wire(cls, wire: tuple[Any, ...]) -> "Settled":
        num_steps, report, error, error_epoch, num_round_trips, warnings, num_token_events = wire
        return cls(num_steps, Report(*report) if report is not None else None, error, error_epoch, num_round_trips,
                   warnings, num_token_events)  # fmt: skip


def main(fd: int, bell_fd: int) -> None:
    """The process's body: take the settings, then write the StepWrites the loop sends until None (or EOF);
    `bell_fd`: the doorbell a pacing writer sleeps on (writer_pacing.py)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the worker's loop decides when the writer stops
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    channel = Channel(fd)
    bell = socket.socket(fileno=bell_fd)
    try:
        settings: ServiceSettings
        settings, *pending = channel.read(None)
    except EOFError:
        channel.close()
        bell.close()
        return
    client = redis_urls.client(str(settings.redis_url), decode_responses=True, health_check_interval=30)
    writer = _Writer(client, Emitter(client, settings))
    pacer = Pacer(is_on=False)  # until the loop says (Pace)
    gc_pauses.settle()  # start-up's objects stay out of every later collection (shared/gc_pauses.py)
    try:
        channel.send(READY)
        while True:
            steps, is_last = _batch(pending or _next_messages(channel, pacer, bell), writer, channel, pacer)
            pending = []
            if steps:
                pacer.read(time.monotonic(), len(steps), steps[-1].engine_idle)
                channel.send(writer.write_batch(steps).wire())
            if is_last:
                return
    except (BrokenPipeError, ConnectionResetError, EOFError):  # the worker is gone
        return
    finally:
        if writer.held is not None:
            writer.held.close()
        client.close()
        channel.close()
        bell.close()


def _next_messages(channel: Channel, pacer: Pacer, bell: socket.socket) -> list[Any]:
    """The loop's next messages: blocked on the pipe, or (pacing) asleep on the doorbell until it rings or a look
    finds some."""
    while True:
        messages = channel.read(0.0)
        if messages:
            return messages
        wait_s = pacer.wait_s(time.monotonic())
        if wait_s is None:
            return channel.read(None)
        if select.select([bell], [], [], wait_s)[0]:
            bell.recv(BELL_READ_BYTES)  # every ring so far: the step it announced is in the pipe already


def _batch(
    messages: list[Any], writer: "_Writer", channel: Channel, pacer: Pacer
) -> tuple[list[StepWrite], bool]:
    """Every message the loop sent so far -> its steps (one pipeline for all of them), and whether the loop said
    stop (None); a Discard among them applies to the steps before it too. Probes (at start) are answered."""
    steps: list[StepWrite] = []
    for message in messages:
        if message is None:
            return steps, True
        if isinstance(message, Discard):
            writer.dead_epoch = max(writer.dead_epoch, message.epoch)
        elif isinstance(message, Probe):
            channel.send(PROBED)
            time.sleep(message.sleep_s)
        elif isinstance(message, Pace):
            pacer.is_on = message.is_on
        else:
            steps.append(StepWrite.of_wire(message))
    return steps, False


class _Writer:
    def __init__(self, client: redis.Redis, emitter: Emitter) -> None:
        self.redis = client
        self.emitter = emitter
        self.dead_epoch = -1  # the newest epoch the loop discarded or a batch here failed in
        # off a Cluster every batch is one pipeline, sent on a connection this process holds (no pool checkout)
        self.held = None if isinstance(client, RedisCluster) else redis_urls.HeldConnection(client)

    def write_batch(self, steps: list[StepWrite]) -> Settled:
        live = [s for s in steps if s.epoch > self.dead_epoch]
        if not live:
            return Settled(len(steps), Report([], []))
        warnings: list[str] = []
        try:
            report, num_token_events = self._write(live, warnings)
        except redis.RedisError as exc:
            epoch = max(s.epoch for s in live)
            self.dead_epoch = max(self.dead_epoch, epoch)
            return Settled(len(steps), error=_picklable(exc), error_epoch=epoch, num_round_trips=1,
                           warnings=warnings)  # fmt: skip
        return Settled(len(steps), report, num_round_trips=1, warnings=warnings, num_token_events=num_token_events)

    def _write(self, steps: list[StepWrite], warnings: list[str]) -> tuple[Report, int]:
        """Every partition's start notices, ONE STEP call and output notices, in one round trip (one pipeline per
        partition node on a Cluster: shared/redis_url.py PartitionPipelines) -> what landed, and how many token
        events."""
        pipes = redis_urls.PartitionPipelines(self.redis, self.held)
        starts = keys.by_partition([n for s in steps for n in s.start_notices], lambda notice: notice[0])
        outputs = keys.by_partition([n for s in steps for n in s.output_notices], lambda notice: notice[0])
        all_writes = [w for s in steps for w in s.writes]
        if len(steps) > 1:  # steps that came while the last batch was written: a job's tokens in one event
            all_writes = coalesce(all_writes)
        writes = keys.by_partition(all_writes, lambda write: write.job_id)
        planned = []  # per partition: its pipeline, its commands' span there, its STEP call's index (or None)
        for partition in sorted(starts.keys() | outputs.keys() | writes.keys()):
            pipe = pipes.of(partition)
            first = len(pipe)
            JobHooks.queue(pipe, starts.get(partition, []))
            call = self.emitter.step_call(writes.get(partition, []))
            step_at = len(pipe) if call[2] else None
            if step_at is not None:
                pipe.evalsha(self.emitter.step_sha, len(call[0]), *call[0], *call[1])
            JobHooks.queue(pipe, outputs.get(partition, []))
            planned.append((pipe, first, len(pipe), step_at, call))
        replies = pipes.execute(raise_on_error=False)
        ended: list[str] = []
        gone: list[str] = []
        num_token_events = 0
        for pipe, first, end, step_at, (call_keys, args, calls) in planned:
            mine = replies[id(pipe)]
            for index in range(first, end):
                if index != step_at and isinstance(mine[index], Exception):  # a lost notice never stops a job
                    warnings.append(f"webhook notice not written: {mine[index]}")
            if step_at is None:
                continue
            step_reply = mine[step_at]
            if isinstance(step_reply, NoScriptError):  # a restarted Redis: nothing of the step ran, send it again
                self.emitter.load_script()
                step_reply = self.redis.evalsha(self.emitter.step_sha, len(call_keys), *call_keys, *args)
            if isinstance(step_reply, Exception):
                raise step_reply
            ended_now, gone_now = self.emitter.settle(calls, list(step_reply))
            num_token_events += sum(1 for call in calls if not call.is_final)
            ended += ended_now
            gone += gone_now
        return Report(ended, gone), num_token_events


def _picklable(exc: redis.RedisError) -> redis.RedisError:
    """`exc` itself when it survives the pipe; else a plain RedisError with its text."""
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:  # an error class whose arguments do not pickle
        return redis.RedisError(f"{type(exc).__name__}: {exc}")
    return exc

