"""The queue reader against a real Redis: priority, anti-starvation, capacity, expiry, reclaim, dead letter."""

import threading
import time

import redis

from shared import keys
from shared.schemas import Priority
from shared.settings import ServiceSettings
from tests.helpers.played_worker import step_output
from tests.helpers.redis_fixtures import job_record, submit_job
from tests.helpers.waiting import wait_until
from workers.worker.emitter import Emitter, Running
from workers.worker.queue_reader import PriorityOrder, QueueReader


def _reader(rclient: redis.Redis, settings: ServiceSettings, name: str = "w1") -> QueueReader:
    reader = QueueReader(rclient, settings, name)
    reader.ensure_groups()
    return reader


def test_highest_priority_first(rclient: redis.Redis, settings: ServiceSettings) -> None:
    reader = _reader(rclient, settings)
    batch = [submit_job(rclient, settings, priority="batch") for _ in range(3)]
    interactive = submit_job(rclient, settings, priority="interactive")
    default = submit_job(rclient, settings)
    taken = [lease.job_id for lease in reader.pull(2)]
    assert taken == [interactive, default]
    assert [lease.job_id for lease in reader.pull(5)] == batch
    lease_status = rclient.hget(keys.job_hash(interactive), "status")
    assert lease_status == "running"


def test_pulls_only_what_fits_and_leaves_the_rest(rclient: redis.Redis, settings: ServiceSettings) -> None:
    jobs = [submit_job(rclient, settings) for _ in range(5)]
    first, second = _reader(rclient, settings, "w1"), _reader(rclient, settings, "w2")
    assert [lease.job_id for lease in first.pull(2)] == jobs[:2]
    assert first.waiting[Priority.DEFAULT]
    assert [lease.job_id for lease in second.pull(10)] == jobs[2:]
    assert first.pull(0) == []
    assert rclient.hget(keys.job_hash(jobs[4]), "worker") == "w2"


def test_anti_starvation_rule() -> None:
    order = PriorityOrder(starvation_limit=2)
    waiting = {p: True for p in Priority}
    assert order.order() == [Priority.INTERACTIVE, Priority.DEFAULT, Priority.BATCH]
    order.record([Priority.INTERACTIVE], waiting)
    order.record([Priority.INTERACTIVE], waiting)
    assert order.order()[:2] == [Priority.DEFAULT, Priority.BATCH]  # both passed over twice
    order.record([Priority.DEFAULT], waiting)
    assert order.order()[0] is Priority.BATCH
    order.record([Priority.BATCH], waiting)
    assert order.order() == [Priority.INTERACTIVE, Priority.DEFAULT, Priority.BATCH]
    order.record([Priority.INTERACTIVE], {p: False for p in Priority})  # nothing waiting: nothing starves
    assert order.num_passed_over[Priority.BATCH] == 0


def test_batch_is_not_starved_by_a_stream_of_interactive_jobs(
    rclient: redis.Redis, settings: ServiceSettings
) -> None:
    settings.starvation_limit = 3
    reader = _reader(rclient, settings)
    batch = submit_job(rclient, settings, priority="batch")
    taken = []
    for _ in range(5):
        submit_job(rclient, settings, priority="interactive")
        taken += [lease.job_id for lease in reader.pull(1)]
    assert batch in taken[:4]


def test_expired_job_never_starts(rclient: redis.Redis, settings: ServiceSettings) -> None:
    expired = submit_job(rclient, settings, ttl_s=0.01)
    fresh = submit_job(rclient, settings)
    wait_until(
        lambda: (
            float(rclient.time()[0]) + rclient.time()[1] / 1e6
            > float(rclient.hget(keys.job_hash(expired), "expires_at"))
        ),
        what="the ttl to pass",
    )
    assert [lease.job_id for lease in _reader(rclient, settings).pull(5)] == [fresh]
    job = job_record(rclient, expired)
    assert job["status"] == "expired" and "started_at" not in job and job["attempt"] == "0"
    last = rclient.xrevrange(keys.job_events(expired), count=1)[0][1]
    assert last["type"] == "error" and '"expired"' in last["data"]
    assert rclient.xlen(keys.queue_stream("default")) == 1  # only the running job's entry


def test_cancelled_job_is_skipped(rclient: redis.Redis, settings: ServiceSettings) -> None:
    job_id = submit_job(rclient, settings)
    rclient.hset(keys.job_hash(job_id), "status", "cancelled")
    assert _reader(rclient, settings).pull(1) == []
    assert rclient.xlen(keys.queue_stream("default")) == 0


def test_dead_worker_job_is_reclaimed_and_resumed(rclient: redis.Redis, settings: ServiceSettings) -> None:
    job_id = submit_job(rclient, settings, max_tokens=10)
    dead = _reader(rclient, settings, "dead")
    lease = dead.pull(1)[0]
    emitter = Emitter(rclient, settings)
    running = {job_id: Running(job_id, lease.attempt, prompt_tokens=3)}
    emitter.emit(running, [step_output(job_id, [5, 6], "ab")])
    alive = _reader(rclient, settings, "alive")
    assert alive.pull(1) == []  # not idle long enough yet
    resumed = wait_until(lambda: alive.pull(1), timeout_s=5, what="the reclaim")[0]
    assert resumed.job_id == job_id and resumed.attempt == 2
    assert (resumed.resumed_text, resumed.resumed_token_ids) == ("ab", [5, 6])
    assert emitter.emit(running, [step_output(job_id, [7], "c")]) == ([], [job_id])  # the old attempt is out
    assert job_record(rclient, job_id).get("text") == "ab"


def test_past_max_deliveries_goes_to_dead_letter(rclient: redis.Redis, settings: ServiceSettings) -> None:
    settings.max_deliveries = 2
    job_id = submit_job(rclient, settings)
    readers = [_reader(rclient, settings, f"w{i}") for i in range(3)]
    assert readers[0].pull(1)[0].attempt == 1
    assert wait_until(lambda: readers[1].pull(1), timeout_s=5)[0].attempt == 2
    deadline = time.monotonic() + 5
    while rclient.hget(keys.job_hash(job_id), "status") == "running" and time.monotonic() < deadline:
        assert readers[2].pull(1) == []
    job = job_record(rclient, job_id)
    assert job["status"] == "failed" and "max_deliveries_exceeded" in job["error"]
    assert rclient.xrange(keys.DEAD_LETTER_STREAM)[0][1]["id"] == job_id
    assert rclient.xlen(keys.queue_stream("default")) == 0


def test_hand_back_requeues_with_progress(rclient: redis.Redis, settings: ServiceSettings) -> None:
    job_id = submit_job(rclient, settings)
    leaving = _reader(rclient, settings, "leaving")
    lease = leaving.pull(1)[0]
    Emitter(rclient, settings).emit({job_id: Running(job_id, 1, 3)}, [step_output(job_id, [1, 2], "xy")])
    assert leaving.hand_back(lease) == "ok"
    job = job_record(rclient, job_id)
    assert job["status"] == "queued" and job["deliveries"] == "0"
    other = _reader(rclient, settings, "other").pull(1)[0]
    assert (other.job_id, other.attempt, other.resumed_text) == (job_id, 2, "xy")
    assert leaving.hand_back(lease) == "lost"


def test_wait_for_jobs_wakes_on_a_new_job(rclient: redis.Redis, settings: ServiceSettings) -> None:
    reader = _reader(rclient, settings)
    assert reader.pull(1) == []
    submitter = threading.Timer(0.2, lambda: submit_job(rclient, settings, priority="batch"))
    submitter.start()
    started = time.monotonic()
    reader.wait_for_jobs(block_ms=5000)
    submitter.join()
    assert time.monotonic() - started < 4
    assert len(reader.pull(1)) == 1


def test_wait_for_jobs_sees_a_job_queued_after_the_pull(
    rclient: redis.Redis, settings: ServiceSettings
) -> None:
    reader = _reader(rclient, settings)
    assert reader.pull(1) == []
    submit_job(rclient, settings)  # lands between the empty pull and the blocking read
    started = time.monotonic()
    reader.wait_for_jobs(block_ms=5000)
    assert time.monotonic() - started < 1


def _calls(client: redis.Redis, command: str) -> int:
    return int(client.info("commandstats").get(f"cmdstat_{command}", {}).get("calls", 0))


def test_a_pull_looks_for_waiting_entries_only_in_a_queue_it_did_not_read_to_its_end(
    rclient: redis.Redis, settings: ServiceSettings
) -> None:
    reader = _reader(rclient, settings)
    for _ in range(3):
        submit_job(rclient, settings)
    looks = _calls(rclient, "xinfo")
    assert len(reader.pull(10)) == 3  # every queue read until it came back empty: nothing waits, no look
    assert reader.waiting == {p: False for p in Priority} and _calls(rclient, "xinfo") == looks
    for _ in range(3):
        submit_job(rclient, settings)
    assert len(reader.pull(2)) == 2  # the room ran out: the default queue is looked at, and one entry waits
    assert reader.waiting[Priority.DEFAULT] and _calls(rclient, "xinfo") > looks
    assert len(reader.pull(1)) == 1  # the last one taken as the room ran out: the look finds none left
    assert reader.waiting == {p: False for p in Priority}


def test_wait_and_pull_starts_a_job_that_comes_while_it_blocks_in_the_same_round_trip(
    rclient: redis.Redis, settings: ServiceSettings
) -> None:
    reader = _reader(rclient, settings)
    assert reader.pull(1) == []
    job_id = submit_job(rclient, settings, priority="batch")  # after the pull: the XREAD sees it
    xreads, scripts = _calls(rclient, "xread"), _calls(rclient, "evalsha")
    leases = reader.wait_and_pull(block_ms=5000, max_jobs=2)
    assert leases is not None and [lease.job_id for lease in leases] == [job_id]
    assert job_record(rclient, job_id)["status"] == "running"
    assert (_calls(rclient, "xread") - xreads, _calls(rclient, "evalsha") - scripts) == (1, 1)  # one write
    assert reader.waiting == {p: False for p in Priority}

    assert reader.wait_and_pull(block_ms=50, max_jobs=2) == []  # nothing came: the PULL behind it took nothing
    assert reader.wait_and_pull(block_ms=50, max_jobs=0) is None  # no room: it only waits


def test_an_announced_job_the_last_pull_saw_is_not_pulled_for_again(
    rclient: redis.Redis, settings: ServiceSettings
) -> None:
    reader = _reader(rclient, settings)
    first = submit_job(rclient, settings)
    assert [lease.job_id for lease in reader.pull(1)] == [first]
    seen = rclient.hget(keys.job_hash(first), "entry")
    assert reader.unseen({Priority.DEFAULT: seen, Priority.BATCH: "0-1"}) == {Priority.BATCH}  # batch: empty then
    later = submit_job(rclient, settings)  # after the pull: unseen
    assert reader.unseen({Priority.DEFAULT: rclient.hget(keys.job_hash(later), "entry")}) == {Priority.DEFAULT}
    assert reader.unseen({Priority.DEFAULT: None}) == {Priority.DEFAULT}  # no entry named: counted
    settings.redis_partitions = 2  # an announcement names no partition: every announced queue counts
    assert QueueReader(rclient, settings, "w2").unseen({Priority.DEFAULT: seen}) == {Priority.DEFAULT}


def test_wait_and_pull_sends_a_refused_pull_again(rclient: redis.Redis, settings: ServiceSettings) -> None:
    """A Redis that lost its scripts (a restart) refuses the PULL behind the XREAD: it goes again, loaded."""
    reader = _reader(rclient, settings)
    assert reader.pull(1) == []
    rclient.script_flush()
    job_id = submit_job(rclient, settings)
    leases = reader.wait_and_pull(block_ms=5000, max_jobs=1)
    assert leases is not None and [lease.job_id for lease in leases] == [job_id]


def test_a_redis_that_lost_its_scripts_or_its_streams_is_pulled_from_again(
    rclient: redis.Redis, settings: ServiceSettings
) -> None:
    """The loop's pulls go out on the connection it holds: a Redis that lost its scripts (a restart) gets the
    script again, and one that lost its streams (flushed) gets its consumer groups again."""
    reader = _reader(rclient, settings)
    first = submit_job(rclient, settings)
    assert [lease.job_id for lease in reader.pull(1)] == [first]
    rclient.script_flush()
    second = submit_job(rclient, settings)
    assert [lease.job_id for lease in reader.pull(1)] == [second]
    rclient.flushall()
    assert reader.pull(1) == []  # NOGROUP: the groups are made again
    third = submit_job(rclient, settings)
    assert [lease.job_id for lease in reader.pull(1)] == [third]
    reader.close()
