"""The worker's loop over a real engine (tiny random model) and a real Redis: one round trip per step for all
jobs, no pull while the engine is full, a cancel honoured within two steps, and a write that fails in the
writer process (or a writer process killed) dropping the jobs, which resume from the last token written with
nothing lost or repeated."""

import json
import logging
import os
import signal
import subprocess
import threading
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import redis

from shared import keys, lua
from shared.job_state import JobStatus
from shared.redis_server import RedisServer
from shared.settings import ServiceSettings
from tests.helpers.redis_fixtures import FAST_TIMINGS, job_record, submit_job
from tests.helpers.waiting import peeked, wait_until
from workers.worker.main import Worker

JOB = {"prompt": "def f(x):", "temperature": 0, "ignore_eos": True}


def _worker(
    client: redis.Redis, settings: ServiceSettings, target: Path, max_num_seqs: int, metrics: Any = None
) -> Worker:
    from workers.engine.config import EngineConfig
    from workers.engine.engine import Engine

    cfg = EngineConfig(target_dir=str(target), kv_cache_mb=16, max_num_seqs=max_num_seqs, num_threads=1,
                       speculative_method="none")  # fmt: skip
    return Worker(Engine(cfg, target), client, settings, worker_id="loop-test", metrics=metrics)


def _started(worker: Worker) -> Worker:
    """start() off the main thread: the test's signal handlers stay as they are."""
    thread = threading.Thread(target=worker.start)
    thread.start()
    thread.join()
    return worker


def _top_level_calls(client: redis.Redis) -> dict[str, int]:
    """Commands run so far by name (INFO commandstats; a script's own commands are counted too)."""
    return {n: s["calls"] for n, s in client.info("commandstats").items() if n != "cmdstat_info"}


def _cancel(client: redis.Redis, settings: ServiceSettings, job_id: str) -> None:
    """What POST /v1/jobs/{id}/cancel runs: the FINISH script to `cancelled` (it tells the workers)."""
    ctx = lua.context(settings.events_maxlen, settings.result_ttl_s)
    event = json.dumps({"status": "cancelled", "error": {"code": "cancelled", "message": "cancelled"}})
    result = client.register_script(lua.FINISH)(
        keys=[keys.job_hash(job_id), keys.job_events(job_id)],
        args=[ctx, job_id, JobStatus.CANCELLED.value, "", "error", event, "error", "{}"],
    )
    assert result == "ok"


def test_one_round_trip_per_step_and_cancel_within_two_steps(
    rclient: redis.Redis, settings: ServiceSettings, tiny_target: Path
) -> None:
    settings.heartbeat_interval_s = 3600.0  # no heartbeat commands among the ones counted
    settings.reclaim_interval_s = 3600.0
    jobs = [submit_job(rclient, settings, max_tokens=400, **JOB) for _ in range(3)]
    worker = _started(_worker(rclient, settings, tiny_target, max_num_seqs=3))
    try:
        for _ in range(3):  # pull (all three fit), prefill, first decode step
            worker.step()
            worker.writer.drain(30)
        assert sorted(worker.running) == sorted(jobs) and worker.engine.free_capacity() == 0
        tokens_before = [int(rclient.hget(keys.job_hash(j), "completion_tokens") or 0) for j in jobs]
        round_trips, before = worker.writer.num_round_trips, _top_level_calls(rclient)
        num_steps = 5
        for _ in range(num_steps):
            worker.step()
            worker.writer.drain(30)
        after = _top_level_calls(rclient)
        ran = {name: after[name] - before.get(name, 0) for name in after if after[name] != before.get(name, 0)}
        assert worker.writer.num_round_trips - round_trips == num_steps
        assert ran.pop("cmdstat_evalsha") == num_steps  # one STEP call per step, all jobs in it; no PULL
        # the STEP script's own commands
        inside = ("hmget", "hset", "hincrby", "xrevrange", "xadd", "publish", "append", "strlen")
        assert set(ran) <= {f"cmdstat_{c}" for c in inside}
        tokens_after = [int(rclient.hget(keys.job_hash(j), "completion_tokens") or 0) for j in jobs]
        assert all(a >= b + num_steps for a, b in zip(tokens_after, tokens_before, strict=True))

        _cancel(rclient, settings, jobs[0])
        num_written = int(rclient.hget(keys.job_hash(jobs[0]), "completion_tokens") or 0)
        for _ in range(2):
            worker.step()
            worker.writer.drain(30)
        assert jobs[0] not in worker.leases and jobs[0] not in worker.running
        assert worker.engine.free_capacity() == 1  # its KV is freed
        job = job_record(rclient, jobs[0])
        assert job["status"] == "cancelled" and int(job["completion_tokens"]) == num_written
        assert sorted(worker.running) == sorted(jobs[1:])
    finally:
        worker.request_stop(0.0)
        worker.shutdown()


def test_an_idle_worker_pulls_first_and_drops_a_job_cancelled_as_it_was_pulled(
    rclient: redis.Redis, settings: ServiceSettings, tiny_target: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker that holds no job pulls before it reads its control channel. A cancel that lands between its
    pull and that read (here: right after the pull) drops the job in the same step, before the engine runs it."""
    settings.reclaim_interval_s = 3600.0
    worker = _started(_worker(rclient, settings, tiny_target, max_num_seqs=2))
    pull = worker.reader.pull
    control_socket = worker._control._pubsub.connection._sock  # the subscription the step reads after its pull

    def pull_then_cancel(max_jobs: int, priorities: Any = None) -> Any:
        leases = pull(max_jobs, priorities)
        for lease in leases:
            _cancel(rclient, settings, lease.job_id)
            # the cancel is on the worker's socket (peeked, not read: the step's own read takes it)
            wait_until(partial(peeked, control_socket, lease.job_id.encode()), interval_s=0.001,
                       what="the cancel on the worker's control socket")  # fmt: skip
        return leases

    monkeypatch.setattr(worker.reader, "pull", pull_then_cancel)
    try:
        job_id = submit_job(rclient, settings, max_tokens=50, **JOB)
        worker.step()
        assert worker.num_pulled_last == 1  # it was pulled in this step ...
        assert job_id not in worker.leases and job_id not in worker.running  # ... and dropped in it
        assert worker.engine.free_capacity() == 2
        worker.writer.drain(30)
        job = job_record(rclient, job_id)
        assert job["status"] == "cancelled" and int(job.get("completion_tokens") or 0) == 0
    finally:
        worker.request_stop(0.0)
        worker.shutdown()


def test_an_idle_worker_starts_a_job_with_the_pull_its_blocking_read_carried(
    rclient: redis.Redis, settings: ServiceSettings, tiny_target: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Idle, the worker blocks on the queues with its PULL behind the XREAD in the same write
    (QueueReader.wait_and_pull): a job submitted meanwhile comes back with the wake-up, and the next step runs it
    without pulling again, and without reading its control channel first (the step after does)."""
    settings.reclaim_interval_s = 3600.0
    settings.idle_block_ms = 5000  # the job comes while it blocks
    worker = _started(_worker(rclient, settings, tiny_target, max_num_seqs=2))
    pulls: list[int] = []
    pull = worker.reader.pull
    try:
        worker.step()  # nothing queued: the worker is idle
        assert worker._is_idle()
        monkeypatch.setattr(worker.reader, "pull", lambda *args: pulls.append(1) or pull(*args))
        control_reads: list[int] = []
        take = worker._control.take
        monkeypatch.setattr(worker._control, "take", lambda: control_reads.append(1) or take())
        submitter = threading.Timer(0.2, lambda: submit_job(rclient, settings, max_tokens=8, **JOB))
        submitter.start()
        worker._wait_and_pull()  # what the loop does when idle
        submitter.join()
        (job_id,) = worker.leases
        assert worker.num_pulled_last == 1 and job_record(rclient, job_id)["status"] == "running"
        steps = worker.clock.num_engine_steps
        worker.step()
        assert job_id in worker.running and pulls == []  # started by the step, not pulled by it
        assert worker.clock.num_engine_steps == steps + 1 and control_reads == []  # the engine's step came first
        worker.step()  # now with room, and its SUBMIT's announcement read: that entry was pulled, no PULL for it
        assert pulls == [] and not worker._jobs_queued and control_reads == [1]
        worker.writer.drain(30)
        assert int(job_record(rclient, job_id)["completion_tokens"]) >= 1

        second = submit_job(rclient, settings, max_tokens=8, **JOB)  # taken while the worker is stopping
        worker.request_stop(10.0)
        worker._wait_and_pull()
        assert second not in worker.leases and worker.num_pulled_last == 0
        job = job_record(rclient, second)
        assert job["status"] == "queued" and job["deliveries"] == "0"  # handed back, not counted as a delivery
    finally:
        worker.request_stop(0.0)
        worker.shutdown()


def test_a_job_cancelled_as_the_idle_wait_pulled_it_writes_nothing_and_is_dropped_a_step_later(
    rclient: redis.Redis, settings: ServiceSettings, tiny_target: Path
) -> None:
    """The step after the idle wait's pull runs the engine before it reads the control channel: a cancel that
    landed in between costs that step, but the STEP script refuses its write (the job is cancelled), and the next
    step drops the job: no token of it is written, its record stays `cancelled`, its KV is free."""
    settings.reclaim_interval_s = 3600.0
    settings.idle_block_ms = 5000
    worker = _started(_worker(rclient, settings, tiny_target, max_num_seqs=2))
    try:
        worker.step()
        assert worker._is_idle()
        submitter = threading.Timer(0.2, lambda: submit_job(rclient, settings, max_tokens=50, **JOB))
        submitter.start()
        worker._wait_and_pull()
        submitter.join()
        (job_id,) = worker.leases
        _cancel(rclient, settings, job_id)
        wait_until(partial(peeked, worker._control._pubsub.connection._sock, job_id.encode()), interval_s=0.001,
                   what="the cancel on the worker's control socket")  # fmt: skip
        worker.step()  # the job's first step: before the cancel is read
        worker.step()  # reads it: dropped
        assert job_id not in worker.leases and job_id not in worker.running
        assert worker.engine.free_capacity() == 2
        worker.writer.drain(30)
        job = job_record(rclient, job_id)
        assert job["status"] == "cancelled" and int(job.get("completion_tokens") or 0) == 0
        assert _token_events(rclient, job_id) == []
    finally:
        worker.request_stop(0.0)
        worker.shutdown()


def test_a_failed_write_drops_the_jobs_and_they_resume_exactly(
    tiny_target: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    server = RedisServer(tmp_path / "redis").start()
    settings = ServiceSettings(redis_url=server.url, **FAST_TIMINGS)  # type: ignore[arg-type]
    client = redis.Redis.from_url(server.url, decode_responses=True)
    worker = _worker(client, settings, tiny_target, max_num_seqs=2)

    def refuse_writes() -> None:
        client.config_set("maxmemory", 1)  # Redis refuses every write: the writer's next step fails
        wait_until(lambda: not worker.leases, what="the worker to drop its jobs")
        client.config_set("maxmemory", 0)

    try:
        _interrupted_jobs_finish_whole(worker, client, settings, refuse_writes, caplog)
    finally:
        client.close()
        server.stop()
    assert any("writing" in r.getMessage() and "failed" in r.getMessage() for r in caplog.records)


def test_a_killed_writer_process_drops_the_jobs_and_they_resume_exactly(
    rclient: redis.Redis, settings: ServiceSettings, tiny_target: Path, caplog: pytest.LogCaptureFixture
) -> None:
    worker = _worker(rclient, settings, tiny_target, max_num_seqs=2)
    killed: list[subprocess.Popen[bytes]] = []

    def kill_the_writer() -> None:
        process = worker.writer._process
        assert process is not None
        os.kill(process.pid, signal.SIGKILL)
        killed.append(process)
        wait_until(lambda: worker.writer._process not in (None, process), what="a new writer process")

    _interrupted_jobs_finish_whole(worker, rclient, settings, kill_the_writer, caplog)
    assert any("writer process exited" in r.getMessage() for r in caplog.records)
    assert killed[0].poll() is not None


def _interrupted_jobs_finish_whole(
    worker: Worker,
    client: redis.Redis,
    settings: ServiceSettings,
    interrupt: Callable[[], None],
    caplog: pytest.LogCaptureFixture,
    max_tokens: int = 300,
) -> None:
    """Run two jobs on `worker` (its loop on a thread), `interrupt` it once both have tokens written, then check
    that both were resumed and finished with all their tokens, each streamed once, in order."""
    thread = threading.Thread(target=worker.run, name="worker")
    thread.start()
    caplog.set_level(logging.WARNING, logger="workers.worker")
    try:
        jobs = [submit_job(client, settings, max_tokens=max_tokens, **JOB) for _ in range(2)]
        wait_until(
            lambda: all(int(client.hget(keys.job_hash(j), "completion_tokens") or 0) > 0 for j in jobs),
            interval_s=0.002,
            what="first tokens",
        )
        interrupt()
        wait_until(
            lambda: all(client.hget(keys.job_hash(j), "status") == "succeeded" for j in jobs),
            timeout_s=60,
            what="the jobs to be reclaimed, resumed and finished",
        )
        records = [job_record(client, j) for j in jobs]
        streams = [client.xrange(keys.job_events(j)) for j in jobs]
    finally:
        worker.request_stop(grace_s=0)
        thread.join(timeout=30)
    assert not thread.is_alive()
    _assert_whole_once(records, streams, max_tokens)


def _assert_whole_once(records: list[Any], streams: list[Any], max_tokens: int) -> None:
    """Each job finished on a later attempt with all its tokens, streamed once each, in order."""
    for job, events in zip(records, streams, strict=True):
        token_ids = [int(t) for t in job["token_ids"].split(",")]
        assert len(token_ids) == max_tokens and job["completion_tokens"] == str(max_tokens)
        assert int(job["attempt"]) >= 2
        streamed = [t for _, e in events if e["type"] == "token" for t in json.loads(e["data"])["token_ids"]]
        assert streamed == token_ids


def _step_until_idle(worker: Worker, max_steps: int = 500) -> None:
    """Step until the worker holds nothing (its jobs finished and their final writes landed)."""
    for _ in range(max_steps):
        worker.step()
        if not worker.leases and worker.num_pulled_last == 0:
            return
    raise AssertionError(f"the worker still holds {sorted(worker.leases)} after {max_steps} steps")


def _run_until_idle(worker: Worker) -> None:
    """Step a started worker until it holds nothing, then stop it."""
    try:
        _step_until_idle(worker)
    finally:
        worker.request_stop(0.0)
        worker.shutdown()


def _token_events(client: redis.Redis, job_id: str) -> list[dict[str, Any]]:
    return [json.loads(e["data"]) for _, e in client.xrange(keys.job_events(job_id)) if e["type"] == "token"]


def test_a_stream_interval_writes_fewer_larger_events_of_the_same_output(
    rclient: redis.Redis, settings: ServiceSettings, tiny_target: Path
) -> None:
    """The worker's stream_interval_ms holds a job's tokens between writes (one event at the first token, one
    with the end); a request's own stream_interval_ms (0 here) overrides it. Same greedy output either way."""
    settings.stream_interval_ms.default = 60_000
    max_tokens = 60
    held = submit_job(rclient, settings, max_tokens=max_tokens, logprobs=1, **JOB)
    plain = submit_job(rclient, settings, max_tokens=max_tokens, logprobs=1, stream_interval_ms=0, **JOB)
    batch = submit_job(rclient, settings, max_tokens=max_tokens, logprobs=1, priority="batch", **JOB)
    worker = _started(_worker(rclient, settings, tiny_target, max_num_seqs=3))
    try:
        for _ in range(20):  # the pull and the prefill, then one token a step
            worker.step()
            worker.writer.drain(30)
        assert worker.hold.interval_s == {held: 60.0, batch: 1.0}  # a batch job's default: settings' `batch`
        assert int(rclient.hget(keys.job_hash(held), "completion_tokens") or 0) == 1  # mid-run: its first token
        assert int(rclient.hget(keys.job_hash(plain), "completion_tokens") or 0) == 20
        for _ in range(max_tokens):  # each step written before the next: the writer's batches hold one step
            worker.step()
            if not worker.running:
                break
            worker.writer.drain(30)
        _step_until_idle(worker)  # the last step's report: the jobs leave
    finally:
        worker.request_stop(0.0)
        worker.shutdown()
    records = {job_id: job_record(rclient, job_id) for job_id in (held, plain, batch)}
    assert {r["status"] for r in records.values()} == {"succeeded"}
    assert records[held]["token_ids"] == records[plain]["token_ids"] == records[batch]["token_ids"]
    assert records[held]["logprobs"] == records[plain]["logprobs"] == records[batch]["logprobs"]
    events = {job_id: _token_events(rclient, job_id) for job_id in (held, plain, batch)}
    assert [len(e["token_ids"]) for e in events[held]] == [1, max_tokens - 1]
    assert len(events[plain]) == max_tokens
    for job_id, job_events in events.items():
        token_ids = [int(t) for t in records[job_id]["token_ids"].split(",")]
        assert [t for e in job_events for t in e["token_ids"]] == token_ids
        assert "".join(e["text"] for e in job_events) == records[job_id]["text"]
        assert [lp for e in job_events for lp in e["logprobs"]] == json.loads(records[job_id]["logprobs"])


def test_a_stopping_worker_writes_the_tokens_it_held_before_handing_the_job_back(
    rclient: redis.Redis, settings: ServiceSettings, tiny_target: Path
) -> None:
    settings.stream_interval_ms.default = 60_000
    max_tokens = 80
    job_id = submit_job(rclient, settings, max_tokens=max_tokens, **JOB)
    worker = _started(_worker(rclient, settings, tiny_target, max_num_seqs=1))
    for _ in range(12):
        worker.step()
        worker.writer.drain(30)
    num_generated = worker.running[job_id].completion_tokens
    assert num_generated > 1 and int(rclient.hget(keys.job_hash(job_id), "completion_tokens") or 0) == 1
    worker.request_stop(0.0)
    worker.shutdown()
    record = job_record(rclient, job_id)
    assert int(record["completion_tokens"]) == num_generated and record["status"] == "queued"

    settings.stream_interval_ms.default = 0
    _run_until_idle(_started(_worker(rclient, settings, tiny_target, max_num_seqs=1)))
    _assert_whole_once([job_record(rclient, job_id)], [rclient.xrange(keys.job_events(job_id))], max_tokens)


def test_a_webhook_output_notice_finds_the_tokens_a_stream_interval_held_written(
    rclient: redis.Redis, settings: ServiceSettings, tiny_target: Path
) -> None:
    """An `output` notice makes the webhook read the job's output: the tokens it is about go out with it."""
    settings.webhook_output_interval_ms = 0  # a notice for every step that gives the job tokens (not its last)
    max_tokens = 12
    job_id = submit_job(rclient, settings, max_tokens=max_tokens, stream_interval_ms=60_000,
                        webhook="https://example.com/hook", webhook_events_filter=["output"], **JOB)  # fmt: skip
    worker = _started(_worker(rclient, settings, tiny_target, max_num_seqs=1))
    written = []  # after each step that left the job running: (tokens generated, tokens in Redis)
    try:
        for _ in range(max_tokens + 5):
            worker.step()
            if job_id not in worker.running:  # its last step: the loop takes its final report below
                break
            worker.writer.drain(30)
            generated = worker.running[job_id].completion_tokens
            written.append((generated, int(rclient.hget(keys.job_hash(job_id), "completion_tokens") or 0)))
        _step_until_idle(worker)
    finally:
        worker.request_stop(0.0)
        worker.shutdown()
    notices = [f for _, f in rclient.xrange(keys.OUTBOX_STREAM) if f["id"] == job_id and f["event"] == "output"]
    assert len(notices) == max_tokens - 1  # one per step but the last (its end is the `completed` notice)
    assert written == [(n, n) for n in range(1, max_tokens)]  # nothing held past its notice
    assert job_record(rclient, job_id)["status"] == "succeeded"


@pytest.mark.parametrize(
    ("corrupt", "field"),
    [
        (lambda stored: json.dumps({**stored, "max_tokens": 0}), "max_tokens"),
        (lambda stored: json.dumps(stored)[:20], None),  # not JSON: the PULL script's own read of it raised
        (lambda stored: "[]", None),  # JSON, not an object: indexing it in the script raised
        (None, None),  # no request at all
    ],
)
def test_a_job_whose_stored_request_does_not_validate_fails_alone(
    rclient: redis.Redis,
    settings: ServiceSettings,
    tiny_target: Path,
    corrupt: Callable[[dict], str] | None,
    field: str | None,
) -> None:
    """A request stored by another version of specfleet (a bound tightened since, as top_k's was) or changed in
    Redis: reading it in the pull raised, and the worker process exited with the jobs it held (here a max_tokens
    of 0); one that was no JSON object failed the PULL script itself, at every pull that met it. Now that job
    fails `invalid_request`, naming the field where there is one, and the others run."""
    bad = submit_job(rclient, settings, max_tokens=4, **JOB)
    stored = json.loads(rclient.hget(keys.job_hash(bad), "request"))
    if corrupt is None:
        rclient.hdel(keys.job_hash(bad), "request")
    else:
        rclient.hset(keys.job_hash(bad), "request", corrupt(stored))
    good = submit_job(rclient, settings, max_tokens=4, **JOB)
    _run_until_idle(_started(_worker(rclient, settings, tiny_target, max_num_seqs=4)))
    failed = job_record(rclient, bad)
    assert failed["status"] == JobStatus.FAILED.value
    error = json.loads(failed["error"])
    assert error["code"] == "invalid_request" and error.get("field") == field
    assert "stored request does not validate" in error["message"]
    assert job_record(rclient, good)["status"] == JobStatus.SUCCEEDED.value
    assert rclient.xpending(keys.queue_stream("default"), keys.CONSUMER_GROUP)["pending"] == 0  # both acked


def test_a_prompt_of_token_ids_runs_and_one_past_the_vocabulary_fails_naming_its_field(
    rclient: redis.Redis, settings: ServiceSettings, tiny_target: Path
) -> None:
    """`prompt_token_ids` goes to the engine as they are (a resumed job appends its output to them); an id the
    engine refuses fails the job with that field (the gateway refuses it first once a worker published its
    vocabulary: keys.MODEL_INFO)."""
    worker = _started(_worker(rclient, settings, tiny_target, max_num_seqs=4))
    vocab = len(worker.engine.tokenizer)
    ids = list(worker.engine.tokenizer.encode("def f(x):", add_special_tokens=False))
    by_text = submit_job(rclient, settings, max_tokens=5, **JOB)
    by_ids = submit_job(rclient, settings, max_tokens=5, **{**JOB, "prompt": None, "prompt_token_ids": ids})
    past = submit_job(rclient, settings, max_tokens=5, **{**JOB, "prompt": None, "prompt_token_ids": [1, vocab]})
    _run_until_idle(worker)
    assert job_record(rclient, by_ids)["token_ids"] == job_record(rclient, by_text)["token_ids"]
    assert json.loads(job_record(rclient, past)["error"])["field"] == "prompt_token_ids"
    assert rclient.hget(keys.MODEL_INFO, "vocab_size") == str(vocab)


def _run_watching_hand_overs(worker: Worker, monkeypatch: pytest.MonkeyPatch, watch: Callable[[Any], None]) -> None:
    """Step `worker` until it holds nothing, `watch` seeing each StepWrite as the loop hands it to the real writer;
    then stop it."""
    submit = worker.writer.submit

    def spy(step: Any) -> None:
        watch(step)
        submit(step)

    monkeypatch.setattr(worker.writer, "submit", spy)
    try:
        wait_until(lambda: worker.step() or not worker.running and not worker.leases, 30, 0.0, "its jobs to end")
    finally:
        worker.request_stop(0.0)
        worker.shutdown()


def test_the_step_that_leaves_the_engine_empty_tells_the_writer(
    rclient: redis.Redis, settings: ServiceSettings, tiny_target: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """StepWrite.engine_idle is set on the step whose outputs finished the engine's last job, not on the one that
    finished a job while another ran (a pacing writer goes back to blocking on its pipe: writer_pacing.py)."""
    settings.reclaim_interval_s = 3600.0
    short = submit_job(rclient, settings, max_tokens=3, **JOB)
    long = submit_job(rclient, settings, max_tokens=7, **JOB)
    worker = _started(_worker(rclient, settings, tiny_target, max_num_seqs=2))
    handed: list[tuple[bool, list[str]]] = []  # per step handed over: engine_idle, the jobs it finished
    _run_watching_hand_overs(
        worker, monkeypatch,
        lambda step: handed.append((step.engine_idle, [write.job_id for write in step.writes if write.is_finished])),
    )  # fmt: skip
    finishing = [(idle, ended) for idle, ended in handed if ended]
    assert finishing == [(False, [short]), (True, [long])]
    end = handed.index((True, [long]))
    assert not any(idle for idle, _ in handed[:end])  # no step before the last job's end said idle


def test_a_step_hands_its_writes_over_before_the_metrics_see_it(
    rclient: redis.Redis, settings: ServiceSettings, tiny_target: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A job's last step reaches the writer before the metrics count the job finished: the refresh a finished job
    brings (gauges, its TTFT and TPOT observed; ~0.1 ms a job, traced in a dev fleet) comes after the hand-over,
    so the final write, and the client's next request behind it, waits for none of it."""
    from prometheus_client import CollectorRegistry

    from workers.worker.engine_metrics import EngineMetrics, JobOutcome

    settings.reclaim_interval_s = 3600.0
    job = submit_job(rclient, settings, max_tokens=3, **JOB)
    metrics = EngineMetrics(CollectorRegistry())
    worker = _started(_worker(rclient, settings, tiny_target, max_num_seqs=2, metrics=metrics))

    def succeeded() -> float | None:
        return metrics.registry.get_sample_value(
            "specfleet_worker_jobs_finished_total", {"outcome": JobOutcome.SUCCEEDED.value}
        )

    counted_at_hand_over: list[float | None] = []  # the metrics' count of finished jobs as each final write was handed

    def watch(step: Any) -> None:
        if any(write.is_finished for write in step.writes):
            counted_at_hand_over.append(succeeded())

    _run_watching_hand_overs(worker, monkeypatch, watch)
    assert counted_at_hand_over == [0.0]
    assert succeeded() == 1.0  # and counted right after
    assert job_record(rclient, job)["status"] == JobStatus.SUCCEEDED.value


def test_with_jobs_in_the_engine_the_loop_takes_the_writers_reports_every_quarter_lag(
    rclient: redis.Redis, settings: ServiceSettings, tiny_target: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read of the writer's reports right after an engine step runs with cold caches: while jobs run, the loop
    reads them every writer_max_lag_ms / 4 only. A job that ended beside a running one stays held (its final
    write landed, its KV free) until then; once the engine is empty every step reads them, and nothing is lost."""
    settings.reclaim_interval_s = 3600.0
    settings.writer_max_lag_ms = 3_600_000.0  # reports every 15 minutes while jobs run: only when the engine empties
    short = submit_job(rclient, settings, max_tokens=3, **JOB)
    long = submit_job(rclient, settings, max_tokens=60, **JOB)
    worker = _started(_worker(rclient, settings, tiny_target, max_num_seqs=2))
    take_reports = worker.writer.take_reports
    reads: list[list[str]] = []  # per read while the engine ran jobs: the jobs the loop held

    def spy(wait_s: float = 0.0) -> Any:
        if worker.running:
            reads.append(sorted(worker.leases))
        return take_reports(wait_s)

    monkeypatch.setattr(worker.writer, "take_reports", spy)
    held_after_its_end: list[bool] = []  # per step of the long job after the short one's final write landed: held?

    def watch(step: Any) -> None:
        if long in worker.running and job_record(rclient, short)["status"] == JobStatus.SUCCEEDED.value:
            held_after_its_end.append(short in worker.leases)

    _run_watching_hand_overs(worker, monkeypatch, watch)
    assert reads == []  # the first step read them with the engine empty, then none for ~60 steps
    assert len(held_after_its_end) > 10 and all(held_after_its_end)  # retired only once the engine emptied
    assert not worker.leases
    for job_id, num_tokens in ((short, 3), (long, 60)):
        record = job_record(rclient, job_id)
        assert record["status"] == JobStatus.SUCCEEDED.value and len(record["token_ids"].split(",")) == num_tokens


def test_a_job_that_ended_beside_a_running_one_is_retired_not_dropped_when_a_heartbeat_finds_it_gone(
    rclient: redis.Redis, settings: ServiceSettings, tiny_target: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Between its final write and the report that retires it, a job's record is final: the heartbeat's script
    answers `gone` for it. The loop leaves it to the report (retired, not "dropped ... cancelled or taken over")."""
    settings.reclaim_interval_s = 3600.0
    settings.heartbeat_interval_s = 3600.0  # beats only when the test calls them
    settings.writer_max_lag_ms = 3_600_000.0  # reports only once the engine empties
    short = submit_job(rclient, settings, max_tokens=2, **JOB)
    long = submit_job(rclient, settings, max_tokens=40, **JOB)
    worker = _started(_worker(rclient, settings, tiny_target, max_num_seqs=2))
    try:
        wait_until(lambda: worker.step() or job_record(rclient, short)["status"] == JobStatus.SUCCEEDED.value,
                   30, 0.0, "the short job's final write to land")  # fmt: skip
        assert long in worker.running and short in worker.leases
        with caplog.at_level(logging.INFO, logger="workers.worker.main"):
            worker.heartbeat.beat()
            assert worker.heartbeat._lost == {short}  # its script answered `gone`
            worker.step()
        assert short in worker.leases and not any(short in r.getMessage() for r in caplog.records)
        wait_until(lambda: worker.step() or not worker.leases, 30, 0.0, "every job to be retired")
    finally:
        worker.request_stop(0.0)
        worker.shutdown()
    assert job_record(rclient, long)["status"] == JobStatus.SUCCEEDED.value
