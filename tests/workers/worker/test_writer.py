"""The writer process: steps land in order, one round trip per batch of steps, a failed write stops every
later write of its epoch (no gap) while the next epoch writes again, and a writer process that dies reaches the
loop as a Redis failure and is replaced."""

import contextlib
import dataclasses
import json
import os
import pickle
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from shared import cpu_placement, keys
from shared.job_state import ErrorCode
from shared.logprobs import TokenLogprob
from shared.redis_server import RedisServer
from shared.schemas import WebhookEvent
from shared.settings import ServiceSettings
from tests.helpers.cpus import ALLOWED, cores_of, needs_two_cores
from tests.helpers.redis_fixtures import FAST_TIMINGS, job_record, submit_job
from workers.worker.emitter import JobFailure, JobWrite, Running
from workers.worker.queue_reader import QueueReader
from workers.worker.writer import Report, StepWrite, StepWriter
from workers.worker.writer_process import Settled


def _take(client: redis.Redis, settings: ServiceSettings, num_jobs: int) -> dict[str, Running]:
    for _ in range(num_jobs):
        submit_job(client, settings)
    reader = QueueReader(client, settings, "w1")
    reader.ensure_groups()
    return {lease.job_id: Running(lease.job_id, lease.attempt, prompt_tokens=3) for lease in reader.pull(num_jobs)}


def _tokens(job: Running, token_id: int, is_finished: bool = False) -> JobWrite:
    job.completion_tokens += 1
    return JobWrite(job.job_id, job.attempt, job.prompt_tokens, job.completion_tokens, new_text=f"<{token_id}>",
                    new_token_ids=(token_id,), finish_reason="length" if is_finished else None,
                    is_finished=is_finished)  # fmt: skip


def _streamed(client: redis.Redis, job_id: str) -> list[str]:
    return [f["data"] for _, f in client.xrange(keys.job_events(job_id)) if f["type"] == "token"]


def test_steps_land_in_order_and_finish_once_landed(rclient: redis.Redis, settings: ServiceSettings) -> None:
    running = _take(rclient, settings, 3)
    writer = StepWriter(settings)
    writer.start()
    try:
        num_steps = 40
        for step in range(num_steps):  # as fast as the loop can hand them over: the writer batches them
            is_last = step == num_steps - 1
            writer.submit(StepWrite(0, [_tokens(job, step, is_last) for job in running.values()]))
        reports = writer.drain(30)
    finally:
        writer.stop()
    assert sorted(j for r in reports for j in r.ended) == sorted(running) and not any(r.gone for r in reports)
    assert 1 <= writer.num_round_trips <= num_steps
    assert writer.num_token_events == sum(len(_streamed(rclient, job_id)) for job_id in running)
    for job_id in running:
        job = job_record(rclient, job_id)
        assert job["status"] == "succeeded" and job["token_ids"] == ",".join(map(str, range(num_steps)))
        events = [json.loads(data) for data in _streamed(rclient, job_id)]
        assert [t for event in events for t in event["token_ids"]] == list(range(num_steps))  # each once, in order
        assert "".join(event["text"] for event in events) == "".join(f"<{i}>" for i in range(num_steps))
        # the steps of one batch (they came while the last was written) are one event per job
        assert len(events) == writer.num_round_trips


def test_a_failed_write_reaches_the_loop_and_stops_its_epoch(tmp_path: Path) -> None:
    server = RedisServer(tmp_path / "redis").start()
    settings = ServiceSettings(redis_url=server.url, **FAST_TIMINGS)  # type: ignore[arg-type]
    client = redis.Redis.from_url(server.url, decode_responses=True)
    writer = StepWriter(settings)
    writer.start()
    try:
        (job,) = _take(client, settings, 1).values()
        writer.submit(StepWrite(0, [_tokens(job, 0)]))
        assert writer.drain(30) == [Report([], [])]
        client.config_set("maxmemory", 1)  # Redis now refuses every write: the next step's write fails
        writer.submit(StepWrite(0, [_tokens(job, 1)]))
        with pytest.raises(redis.RedisError):
            writer.drain(30)
        client.config_set("maxmemory", 0)
        writer.submit(StepWrite(0, [_tokens(job, 2)]))  # queued before the loop saw the failure: skipped
        assert writer.drain(30) == [Report([], [])]
        assert job_record(client, job.job_id).get("token_ids") == "0"  # no gap: token 2 never landed
        writer.discard(0)  # the loop dropped its jobs; a new epoch writes again, and Redis itself refuses a gap:
        writer.submit(StepWrite(1, [_tokens(job, 3)]))  # it follows tokens 1 and 2, which never landed
        assert writer.drain(30) == [Report([], [job.job_id])]
        assert job_record(client, job.job_id).get("token_ids") == "0"
    finally:
        writer.stop()
        client.close()
        server.stop()


def test_a_dead_writer_process_fails_the_epoch_and_is_replaced(rclient: redis.Redis, settings: ServiceSettings) -> None:
    (job,) = _take(rclient, settings, 1).values()
    writer = StepWriter(settings)
    writer.start()
    try:
        writer.submit(StepWrite(0, [_tokens(job, 0)]))
        assert writer.drain(30) == [Report([], [])]
        assert writer._process is not None
        os.kill(writer._process.pid, signal.SIGKILL)
        writer._process.wait(30)
        writer.submit(StepWrite(0, [_tokens(job, 1)]))  # its socket is closed: lost, as in a Redis outage
        with pytest.raises(redis.ConnectionError, match="writer process exited"):
            writer.drain(30)
        writer.discard(0)  # what the loop does after a Redis failure: a new process takes the next epoch
        writer.submit(StepWrite(1, [_tokens(job, 2)]))
        assert writer.drain(30) == [Report([], [job.job_id])]  # Redis refuses the gap: token 1 never landed
        assert job_record(rclient, job.job_id).get("token_ids") == "0"
    finally:
        writer.stop()


def test_a_replayed_write_lands_once(rclient: redis.Redis, settings: ServiceSettings) -> None:
    (job,) = _take(rclient, settings, 1).values()
    writer = StepWriter(settings)
    writer.start()
    try:
        write = _tokens(job, 7)
        writer.submit(StepWrite(0, [write]))
        writer.submit(StepWrite(0, [write]))  # as a pipeline retried after its reply was lost would send it
        reports = writer.drain(30)
    finally:
        writer.stop()
    assert not any(r.gone for r in reports)
    assert job_record(rclient, job.job_id).get("token_ids") == "7"
    assert len(_streamed(rclient, job.job_id)) == 1


@needs_two_cores
def test_the_writer_process_runs_on_the_io_cores(rclient: redis.Redis, settings: ServiceSettings) -> None:
    (job,) = _take(rclient, settings, 1).values()
    io_cpus = frozenset({min(ALLOWED)})
    writer = StepWriter(settings, io_cpus=io_cpus)
    with cpu_placement.bound(ALLOWED - io_cpus):  # the worker's main thread, on its engine cores
        writer.start()
    try:
        assert writer._process is not None
        assert cores_of(writer._process.pid) == io_cpus
        writer.submit(StepWrite(0, [_tokens(job, 0)]))
        assert writer.drain(30) == [Report([], [])]  # it writes from there
    finally:
        writer.stop()
    assert job_record(rclient, job.job_id).get("token_ids") == "0"


def test_what_crosses_the_pipe_as_tuples_comes_back_whole() -> None:
    """The loop pickles plain tuples (JobWrite.wire): every field of every write, a step and a writer's answer
    survive the round trip, and a field added later cannot be forgotten by wire()."""
    failure = JobFailure(ErrorCode.TIMEOUT, "ran past its deadline", "timeout_s", {"compute_s": 0.5})
    logprob = TokenLogprob(token="a", token_id=7, logprob=-0.25)
    write = JobWrite("job-1", 2, 5, 9, new_text="ab", new_token_ids=(7, 8), finish_reason="stop", is_finished=True,
                     metrics={"ttft_ms": 3.0}, failure=failure, new_logprobs=(logprob,), prompt_logprobs=(logprob,),
                     record_fields=("logprobs", "[]"), cached_tokens=4)  # fmt: skip
    assert {f.name: getattr(write, f.name) != f.default for f in dataclasses.fields(JobWrite)} == {
        f.name: True for f in dataclasses.fields(JobWrite)}  # every field set: the round trip checks them all
    assert len(write.wire()) == len(dataclasses.fields(JobWrite))
    assert JobWrite.of_wire(pickle.loads(pickle.dumps(write.wire()))) == write
    step = StepWrite(3, [write, JobWrite("job-2", 1, 4, 1)], [("job-1", WebhookEvent.START)],
                     [("job-2", WebhookEvent.OUTPUT)], engine_idle=True)  # fmt: skip
    assert StepWrite.of_wire(pickle.loads(pickle.dumps(step.wire()))) == step
    for settled in (Settled(2, Report(["job-1"], ["job-2"]), num_round_trips=1, warnings=["a notice"]),
                    Settled(1, error=redis.ConnectionError("gone"), error_epoch=3, num_round_trips=1)):  # fmt: skip
        back = Settled.of_wire(pickle.loads(pickle.dumps(settled.wire())))
        assert (back.num_steps, back.report, back.error_epoch, back.num_round_trips, back.warnings) == (
            settled.num_steps, settled.report, settled.error_epoch, settled.num_round_trips, settled.warnings)
        assert str(back.error) == str(settled.error)


@contextlib.contextmanager
def _stopped(server: RedisServer, resume_after_s: float) -> Iterator[threading.Event]:
    """Redis stopped (SIGSTOP): nothing it is sent runs until it is resumed, `resume_after_s` later, by a timer;
    the event is set as it resumes."""
    resumed = threading.Event()

    def resume() -> None:
        resumed.set()
        os.kill(server.process.pid, signal.SIGCONT)

    os.kill(server.process.pid, signal.SIGSTOP)
    timer = threading.Timer(resume_after_s, resume)
    timer.start()
    try:
        yield resumed
    finally:
        timer.cancel()
        os.kill(server.process.pid, signal.SIGCONT)


def test_a_writer_behind_by_less_than_the_lag_lets_the_loop_on(tmp_path: Path) -> None:
    """Redis stalls: the loop hands over step after step without waiting for the writer (a bound of 3 steps made
    the fourth wait for the first to land), and the writer then lands them in order, several to a round trip."""
    with RedisServer(tmp_path / "redis") as server, redis.Redis.from_url(server.url, decode_responses=True) as client:
        settings = ServiceSettings(redis_url=server.url, writer_max_lag_ms=60_000, **FAST_TIMINGS)  # type: ignore[arg-type]
        (job,) = _take(client, settings, 1).values()
        writer = StepWriter(settings)
        writer.start()
        num_steps = 10
        try:
            with _stopped(server, resume_after_s=1.0) as resumed:
                for step in range(num_steps):
                    writer.submit(StepWrite(0, [_tokens(job, step, step == num_steps - 1)]))
                assert not resumed.is_set() and writer.num_unsettled == num_steps  # none waited for Redis
            reports = writer.drain(30)
        finally:
            writer.stop()
        assert [j for r in reports for j in r.ended] == [job.job_id]
        assert job_record(client, job.job_id)["token_ids"] == ",".join(map(str, range(num_steps)))
        assert writer.num_round_trips < num_steps


@pytest.mark.parametrize("bound", ["lag", "count"])
def test_a_writer_too_far_behind_holds_the_loop(tmp_path: Path, bound: str) -> None:
    """Redis stalls: once the oldest step not landed was handed over more than writer_max_lag_ms ago (or
    max_pending steps wait), the next hand-over waits for Redis."""
    lag_ms, max_pending = (1.0, 64) if bound == "lag" else (60_000.0, 4)
    with RedisServer(tmp_path / "redis") as server, redis.Redis.from_url(server.url, decode_responses=True) as client:
        settings = ServiceSettings(redis_url=server.url, writer_max_lag_ms=lag_ms, **FAST_TIMINGS)  # type: ignore[arg-type]
        (job,) = _take(client, settings, 1).values()
        writer = StepWriter(settings, max_pending=max_pending)
        writer.start()
        num_free = 1 if bound == "lag" else max_pending  # hand-overs that do not wait
        try:
            with _stopped(server, resume_after_s=0.5) as resumed:
                for step in range(num_free):
                    writer.submit(StepWrite(0, [_tokens(job, step)]))
                time.sleep(0.01)  # the oldest step is now older than a 1 ms lag
                assert not resumed.is_set()
                writer.submit(StepWrite(0, [_tokens(job, num_free, True)]))
                assert resumed.is_set()  # it waited for Redis
            writer.drain(30)
        finally:
            writer.stop()
        assert job_record(client, job.job_id)["token_ids"] == ",".join(map(str, range(num_free + 1)))
