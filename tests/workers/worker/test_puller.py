"""The puller thread against a real Redis: it starts announced jobs only while armed, no more than its room, never
for an entry the pulls already saw, catches up at arm() on what was announced meanwhile, and hands a failed pull
to take(); and in the worker's loop over a real engine: a job announced while the engine steps starts at the next
boundary without the loop pulling, a full engine arms nothing, a stopping worker hands such jobs back."""

import threading
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import redis

from shared import keys
from shared.schemas import Priority
from shared.settings import ServiceSettings
from tests.helpers.redis_fixtures import job_record, submit_job
from tests.helpers.waiting import peeked, wait_until
from workers.worker.engine_metrics import EngineMetrics
from workers.worker.main import Worker
from workers.worker.puller import Puller
from workers.worker.queue_reader import QueueReader

JOB = {"prompt": "def f(x):", "temperature": 0, "ignore_eos": True}


@pytest.fixture
def reader(rclient: redis.Redis, settings: ServiceSettings) -> QueueReader:
    reader = QueueReader(rclient, settings, "w1")
    reader.ensure_groups()
    return reader


@pytest.fixture
def puller(rclient: redis.Redis) -> Iterator[Puller]:
    puller = Puller(rclient)
    puller.subscribe()
    puller.start()
    yield puller
    puller.stop()


def _taken(puller: Puller, reader: QueueReader) -> list[str]:
    """take(), read as the loop reads it -> the ids of the jobs the puller started, in order."""
    replies, in_flight = puller.take(wait=True)
    assert not in_flight
    leases = [lease for call, reply in replies for lease in reader.read_pulled(call, reply) or []]
    return [lease.job_id for lease in leases]


def _call(reader: QueueReader):  # noqa: ANN202
    call = reader.pull_call()
    assert call is not None  # one partition, a standalone Redis
    return call


def test_an_armed_puller_starts_announced_jobs_up_to_its_room(
    rclient: redis.Redis, settings: ServiceSettings, reader: QueueReader, puller: Puller
) -> None:
    puller.arm(_call(reader), room=2)
    jobs = []
    for num_pulls in (1, 2):  # one at a time: each announcement its own pull
        jobs.append(submit_job(rclient, settings, **JOB))
        wait_until(lambda n=num_pulls: puller.num_pulls == n, what=f"pull {num_pulls}")
        assert job_record(rclient, jobs[-1])["status"] == "running"
    third = submit_job(rclient, settings, **JOB)  # its room is spent: no pull for it
    assert _taken(puller, reader) == jobs  # the loop reads the replies as its own pull's
    assert job_record(rclient, third)["status"] == "queued" and puller.num_pulls == 2
    assert reader.last_ids[(0, Priority.DEFAULT)] != "0-0"  # what its pulls saw is the reader's now
    puller.arm(_call(reader), room=1)  # armed again: the third's announcement came meanwhile, unseen -> at once
    wait_until(lambda: puller.num_pulls == 3, what="the pull for the announcement that waited")
    assert _taken(puller, reader) == [third]


def test_no_pull_for_an_entry_the_loops_pull_saw_nor_while_disarmed(
    rclient: redis.Redis, settings: ServiceSettings, reader: QueueReader, puller: Puller
) -> None:
    first = submit_job(rclient, settings, **JOB)
    assert [lease.job_id for lease in reader.pull(1)] == [first]  # the loop pulled it itself
    wait_until(lambda: puller._announced.queued, what="its announcement at the puller")
    puller.arm(_call(reader), room=4)  # that announcement is seen: nothing to pull for
    second = submit_job(rclient, settings, **JOB)
    wait_until(lambda: puller.num_pulls >= 1, what="the pull for the second")
    assert _taken(puller, reader) == [second] and puller.num_pulls == 1  # one pull: none for the first

    third = submit_job(rclient, settings, **JOB)  # disarmed by that take(): announced, not pulled
    wait_until(lambda: puller._announced.queued, what="its announcement at the puller")
    assert job_record(rclient, third)["status"] == "queued" and puller.take() == ([], False)
    assert [lease.job_id for lease in reader.pull(1)] == [third]


def test_a_failed_pull_is_raised_once_by_take_and_the_next_pull_connects_again(
    rclient: redis.Redis, settings: ServiceSettings, reader: QueueReader, puller: Puller
) -> None:
    puller.arm(_call(reader), room=2)
    first = submit_job(rclient, settings, **JOB)
    wait_until(lambda: puller.num_pulls == 1, what="the first pull")
    rclient.client_kill_filter(_type="normal", skipme=True)  # the puller's pull connection (not its subscription)
    second = submit_job(rclient, settings, **JOB)
    wait_until(lambda: puller.num_pulls == 2, what="the second pull")
    with pytest.raises(redis.ConnectionError):
        puller.take(wait=True)
    assert puller.take() == ([], False)  # raised once; the reply before it went with it (the loop drops what it holds)
    assert job_record(rclient, second)["status"] == "queued"  # the failed pull started nothing
    assert job_record(rclient, first)["status"] == "running"
    puller.arm(_call(reader), room=2)
    third = submit_job(rclient, settings, **JOB)
    wait_until(lambda: puller.num_pulls == 3, what="the third pull")
    assert _taken(puller, reader) == [second, third]  # the second's announcement waited, unseen


def test_a_puller_whose_subscription_was_cut_subscribes_again_and_pulls(
    rclient: redis.Redis, settings: ServiceSettings, reader: QueueReader, puller: Puller,
    caplog: pytest.LogCaptureFixture,
) -> None:
    def num_subscribers() -> int:
        ((_, num),) = rclient.pubsub_numsub(keys.QUEUED_CHANNEL)
        return int(num)

    assert num_subscribers() == 1  # the puller's subscription, no other here
    puller.arm(_call(reader), room=2)
    rclient.client_kill_filter(_type="pubsub")
    wait_until(lambda: num_subscribers() == 0, what="the subscription cut")
    wait_until(lambda: num_subscribers() == 1, timeout_s=10, what="the puller subscribed again")
    assert "its subscription failed" in caplog.text  # through the thread's failure path (its socket unregistered)
    job = submit_job(rclient, settings, **JOB)  # announced on the new subscription
    wait_until(lambda: puller.num_pulls == 1, what="the pull for it")
    assert _taken(puller, reader) == [job]


def test_a_resting_puller_reads_nothing_until_armed_and_then_pulls_for_what_came(
    rclient: redis.Redis, settings: ServiceSettings, reader: QueueReader, puller: Puller
) -> None:
    puller.rest()  # the engine is empty: the loop's idle wait pulls
    job = submit_job(rclient, settings, **JOB)
    wait_until(partial(peeked, puller._pubsub.connection._sock, keys.QUEUED_CHANNEL.encode()), interval_s=0.001,
               what="the announcement left in the resting puller's socket")  # fmt: skip
    assert not puller._announced.queued and puller.num_pulls == 0
    puller.arm(_call(reader), room=1)  # watching again: it reads what waited, unseen by the pulls -> pulls
    wait_until(lambda: puller.num_pulls == 1, what="the pull for what came while it rested")
    assert _taken(puller, reader) == [job]


def test_take_does_not_wait_for_a_pull_in_flight_and_pull_now_pulls_for_jobs_left_waiting(
    rclient: redis.Redis, settings: ServiceSettings, reader: QueueReader, puller: Puller
) -> None:
    jobs = [submit_job(rclient, settings, **JOB) for _ in range(3)]
    assert [lease.job_id for lease in reader.pull(1)] == jobs[:1]  # the loop's pull: two left waiting
    wait_until(lambda: puller._announced.queued, what="the announcements at the puller")
    call = _call(reader)
    rclient.client_pause(2000)  # Redis holds every client's commands for 2 s: the pull below stays in flight
    puller.arm(call, room=2, pull_now=True)  # the announcements were seen, yet jobs are known to wait
    wait_until(lambda: puller._in_flight, what="the pull in flight")
    assert puller.take() == ([], True)  # no wait; it stays armed
    wait_until(lambda: puller.num_pulls == 1, what="the pull's reply")
    assert _taken(puller, reader) == jobs[1:]


def test_a_pull_refused_for_lost_streams_reads_as_none(
    rclient: redis.Redis, settings: ServiceSettings, reader: QueueReader, puller: Puller
) -> None:
    call = _call(reader)
    puller.arm(call, room=2)
    for stream in call.keys:
        rclient.delete(stream)  # a flushed Redis: NOGROUP
    rclient.publish(keys.QUEUED_CHANNEL, "default")  # an announcement without its entry: always pulled for
    wait_until(lambda: puller.num_pulls == 1, what="the refused pull")
    ((taken_call, reply),), _ = puller.take(wait=True)
    assert reader.read_pulled(taken_call, reply) is None  # the loop pulls the usual way (which makes the groups)
    job = submit_job(rclient, settings, **JOB)
    assert [lease.job_id for lease in reader.pull(2)] == [job]


# -- in the worker's loop ----------------------------------------------------------------------------------------
def _worker(
    client: redis.Redis, settings: ServiceSettings, target: Path, max_num_seqs: int, metrics: Any = None
) -> Worker:
    from workers.engine.config import EngineConfig
    from workers.engine.engine import Engine

    cfg = EngineConfig(target_dir=str(target), kv_cache_mb=16, max_num_seqs=max_num_seqs, num_threads=1,
                       speculative_method="none")  # fmt: skip
    worker = Worker(Engine(cfg, target), client, settings, worker_id="puller-test", metrics=metrics)
    thread = threading.Thread(target=worker.start)  # off the main thread: the test's signal handlers stay
    thread.start()
    thread.join()
    return worker


def _stepping(
    client: redis.Redis, settings: ServiceSettings, target: Path, monkeypatch: pytest.MonkeyPatch, metrics: Any = None
) -> tuple[Worker, str, list[int]]:
    """A worker (2 slots) whose first step pulled one job of 40 tokens and armed its puller -> it, that job, and
    the loop's own pulls from then on (one item each). The caller stops it."""
    settings.reclaim_interval_s = 3600.0  # no reclaim pull of the loop's
    first = submit_job(client, settings, max_tokens=40, **JOB)
    worker = _worker(client, settings, target, max_num_seqs=2, metrics=metrics)
    worker.step()  # pulls the first (the loop's own pull), arms the puller with the room left
    assert first in worker.running and worker.puller is not None
    pulls: list[int] = []
    pull = worker.reader.pull
    monkeypatch.setattr(worker.reader, "pull", lambda *args: pulls.append(1) or pull(*args))
    return worker, first, pulls


def test_a_job_announced_while_the_engine_steps_starts_at_the_next_boundary_without_a_loop_pull(
    rclient: redis.Redis, settings: ServiceSettings, tiny_target: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    metrics = EngineMetrics()
    worker, first, pulls = _stepping(rclient, settings, tiny_target, monkeypatch, metrics)
    try:
        assert worker.puller is not None
        second = submit_job(rclient, settings, max_tokens=8, **JOB)
        wait_until(lambda: worker.puller.num_pulls == 1, what="the puller's pull")  # while the loop is not looking
        assert second not in worker.leases
        worker.step()  # its boundary admits it; the control channel's announcement is seen: no pull of the loop's
        assert second in worker.running and pulls == [] and not worker._jobs_queued
        while worker.leases:
            worker.step()
        worker.writer.drain(30)
        assert job_record(rclient, second)["status"] == "succeeded" and pulls == []
        assert int(job_record(rclient, second)["completion_tokens"]) == 8
        pulled = {by: metrics.registry.get_sample_value("specfleet_worker_pulled_jobs_total", {"by": by})
                  for by in ("loop", "puller")}  # fmt: skip
        assert pulled == {"loop": 1.0, "puller": 1.0}
    finally:
        worker.request_stop(0.0)
        worker.shutdown()


def test_a_job_whose_announcement_the_loop_read_first_is_pulled_by_the_puller_a_step_later(
    rclient: redis.Redis, settings: ServiceSettings, tiny_target: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The loop never waits on a PULL while the engine runs jobs: an announcement it read itself arms the
    puller with `pull_now`, and the job starts at the boundary after (here the puller hears no announcement)."""
    monkeypatch.setattr(Puller, "subscribe", lambda self: None)  # deaf: only the loop reads announcements
    worker, _, pulls = _stepping(rclient, settings, tiny_target, monkeypatch)
    try:
        assert worker.puller is not None
        second = submit_job(rclient, settings, max_tokens=8, **JOB)
        wait_until(partial(peeked, worker._control._pubsub.connection._sock, keys.QUEUED_CHANNEL.encode()),
                   interval_s=0.001, what="its announcement on the loop's control socket")  # fmt: skip
        worker.step()  # reads the announcement: arms the puller to pull at once, does not pull itself
        assert second not in worker.leases and pulls == []
        wait_until(lambda: worker.puller.num_pulls == 1, what="the puller's pull")
        worker.step()
        assert second in worker.running and pulls == []
    finally:
        worker.request_stop(0.0)
        worker.shutdown()


def test_a_boundary_does_not_wait_for_the_pullers_pull_and_weighs_what_it_read_meanwhile_after_its_reply(
    rclient: redis.Redis, settings: ServiceSettings, tiny_target: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A boundary with the puller's pull in flight neither waits for it nor pulls: the announcement the loop
    read meanwhile is weighed once that reply is read, and the job the reply started needs no pull of the
    loop's."""
    worker, first, pulls = _stepping(rclient, settings, tiny_target, monkeypatch)
    release = threading.Event()
    try:
        assert worker.puller is not None
        execute = worker.puller._held.execute
        monkeypatch.setattr(worker.puller._held, "execute", lambda commands: release.wait(10) and execute(commands))
        second = submit_job(rclient, settings, max_tokens=8, **JOB)
        wait_until(lambda: worker.puller._in_flight, what="the puller's pull in flight (held back)")
        wait_until(partial(peeked, worker._control._pubsub.connection._sock, keys.QUEUED_CHANNEL.encode()),
                   interval_s=0.001, what="the announcement on the loop's control socket")  # fmt: skip
        worker.step()  # no wait, no pull: the announcement is kept for after the reply
        assert worker._pull_in_flight and worker._announced_in_flight and not worker._jobs_queued
        assert second not in worker.leases and pulls == [] and first in worker.running
        release.set()
        wait_until(lambda: worker.puller.num_pulls == 1, what="the puller's reply")
        worker.step()  # admits it; the announcement it read is seen by that pull: nothing more to pull
        assert second in worker.running and pulls == []
        assert not worker._pull_in_flight and not worker._announced_in_flight and not worker._jobs_queued
    finally:
        release.set()
        worker.request_stop(0.0)
        worker.shutdown()


def test_a_pull_refused_for_lost_streams_makes_the_loop_pull_which_makes_them_again(
    rclient: redis.Redis, settings: ServiceSettings, tiny_target: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    worker, _, pulls = _stepping(rclient, settings, tiny_target, monkeypatch)
    try:
        assert worker.puller is not None
        for priority in Priority:
            rclient.delete(keys.queue_stream(priority, 0))  # a flushed Redis: NOGROUP
        rclient.publish(keys.QUEUED_CHANNEL, "default")
        wait_until(lambda: worker.puller.num_pulls == 1, what="the refused pull")
        worker.step()  # reads the refusal: the loop's own pull, which makes the groups again
        assert pulls == [1] and not worker._pull_refused
        assert all(rclient.xinfo_groups(keys.queue_stream(p, 0)) for p in Priority)
        second = submit_job(rclient, settings, max_tokens=8, **JOB)
        wait_until(lambda: worker.puller.num_pulls == 2, what="the puller's next pull")
        worker.step()
        assert second in worker.running and pulls == [1]  # the puller's again
    finally:
        worker.request_stop(0.0)
        worker.shutdown()


def test_a_puller_thread_that_fails_leaves_the_pulls_to_the_loop(
    rclient: redis.Redis, settings: ServiceSettings, tiny_target: Path, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    worker, first, _ = _stepping(rclient, settings, tiny_target, monkeypatch)
    try:
        assert worker.puller is not None

        def bug(commands: object) -> object:
            raise RuntimeError("a bug in the thread")

        monkeypatch.setattr(worker.puller._held, "execute", bug)
        second = submit_job(rclient, settings, max_tokens=8, **JOB)
        wait_until(lambda: not worker.puller.is_alive(), what="the puller thread's end")
        assert "the thread failed" in caplog.text
        worker.step()  # the loop reads the announcement and pulls for itself; the worker goes on
        assert second in worker.running and first in worker.running
        assert worker.puller.take() == ([], False)
    finally:
        worker.request_stop(0.0)
        worker.shutdown()


def test_a_full_engine_arms_no_puller_and_a_stopping_worker_hands_its_jobs_back(
    rclient: redis.Redis, settings: ServiceSettings, tiny_target: Path
) -> None:
    settings.reclaim_interval_s = 3600.0
    first = submit_job(rclient, settings, max_tokens=400, **JOB)
    worker = _worker(rclient, settings, tiny_target, max_num_seqs=1)
    try:
        worker.step()
        assert first in worker.running and worker.engine.free_capacity() == 0
        waiting = submit_job(rclient, settings, max_tokens=8, **JOB)
        for _ in range(5):  # full: never armed, so nothing pulled however long it steps
            worker.step()
        assert worker.puller is not None and worker.puller.num_pulls == 0
        assert job_record(rclient, waiting)["status"] == "queued"
    finally:
        worker.request_stop(0.0)
        worker.shutdown()

    settings.reclaim_interval_s = 3600.0
    second = submit_job(rclient, settings, max_tokens=400, **JOB)
    worker = _worker(rclient, settings, tiny_target, max_num_seqs=4)
    try:
        worker.step()  # the three queued jobs (two handed back above, and this one): armed with room 1
        assert worker.puller is not None and len(worker.running) == 3
        third = submit_job(rclient, settings, max_tokens=8, **JOB)
        wait_until(lambda: worker.puller.num_pulls == 1, what="the puller's pull")
        worker.request_stop(10.0)
        worker.step()  # stopping: what the puller started goes straight back
        assert third not in worker.leases
        job = job_record(rclient, third)
        assert job["status"] == "queued" and job["deliveries"] == "0"
        fourth = submit_job(rclient, settings, max_tokens=8, **JOB)  # a stopping worker arms nothing
        worker.step()
        assert job_record(rclient, fourth)["status"] == "queued" and worker.puller.num_pulls == 1
        assert set(worker.running) == {first, second, waiting}
    finally:
        worker.request_stop(0.0)
        worker.shutdown()
    for job_id in (first, second, waiting):
        assert job_record(rclient, job_id)["status"] == "queued"  # all handed back by the shutdowns
