"""The worker's Redis side with 3 partitions (settings.redis_partitions, shared/keys.py) on a real Redis: pulls
take every partition's interactive jobs before any default one and rotate the partition they start with;
reclaim, heartbeat, one step's writes (one STEP call per partition), hand-back and the dead letters each stay in
the job's own partition."""

import pytest
import redis

from shared import keys
from shared.dlq import DeadLetters
from shared.schemas import Priority
from shared.settings import ServiceSettings
from tests.helpers.played_worker import step_output
from tests.helpers.redis_fixtures import job_record, submit_job
from tests.helpers.waiting import wait_until
from workers.worker.emitter import Emitter, Running
from workers.worker.heartbeat import Heartbeat
from workers.worker.queue_reader import Lease, QueueReader

NUM_PARTITIONS = 3


@pytest.fixture
def partitioned(settings: ServiceSettings) -> ServiceSettings:
    settings.redis_partitions = NUM_PARTITIONS
    return settings


def _reader(rclient: redis.Redis, settings: ServiceSettings, name: str = "w1") -> QueueReader:
    reader = QueueReader(rclient, settings, name)
    reader.ensure_groups()
    return reader


def test_interactive_jobs_of_every_partition_come_before_any_default_one(
    rclient: redis.Redis, partitioned: ServiceSettings
) -> None:
    reader = _reader(rclient, partitioned)
    default = submit_job(rclient, partitioned, partition=0)
    interactive = [submit_job(rclient, partitioned, partition=p, priority="interactive") for p in (2, 1)]
    batch = submit_job(rclient, partitioned, partition=1, priority="batch")
    taken = [lease.job_id for lease in reader.pull(2)]
    assert sorted(taken) == sorted(interactive)
    assert reader.waiting[Priority.DEFAULT] and reader.waiting[Priority.BATCH]  # seen without being taken
    assert not reader.waiting[Priority.INTERACTIVE]
    assert [lease.job_id for lease in reader.pull(5)] == [default, batch]
    for job_id in (*interactive, default, batch):
        assert rclient.hget(keys.job_hash(job_id), "status") == "running"
        assert keys.job_hash(job_id).startswith(keys.prefix(keys.partition_of(job_id)))
    for partition in range(NUM_PARTITIONS):  # each job's entry was read from its own partition's stream
        for priority in Priority:
            assert rclient.xlen(keys.queue_stream(priority, partition)) == sum(
                1 for j, p in ((interactive[0], "interactive"), (interactive[1], "interactive"), (default, "default"),
                               (batch, "batch"))  # fmt: skip
                if keys.partition_of(j) == partition and p == priority.value
            )


def test_the_partition_a_pull_starts_with_rotates(rclient: redis.Redis, partitioned: ServiceSettings) -> None:
    reader = _reader(rclient, partitioned)
    firsts = []
    for _ in range(NUM_PARTITIONS):
        for partition in range(NUM_PARTITIONS):
            submit_job(rclient, partitioned, partition=partition)
        firsts.append(keys.partition_of(reader.pull(1)[0].job_id))
        reader.pull(NUM_PARTITIONS)  # the rest
    assert sorted(firsts) == list(range(NUM_PARTITIONS))  # no partition served first every time


def test_reclaim_heartbeat_writes_and_hand_back_stay_in_the_job_partition(
    rclient: redis.Redis, partitioned: ServiceSettings
) -> None:
    jobs = [submit_job(rclient, partitioned, partition=p, max_tokens=10) for p in range(NUM_PARTITIONS)]
    holder = _reader(rclient, partitioned, "holder")
    leases = holder.pull(NUM_PARTITIONS)
    assert sorted(lease.job_id for lease in leases) == sorted(jobs)
    heartbeat = Heartbeat(rclient, partitioned, "holder", lambda: leases)
    heartbeat.beat()
    assert heartbeat.take_lost() == set()
    emitter = Emitter(rclient, partitioned)
    running = {lease.job_id: Running(lease.job_id, lease.attempt, prompt_tokens=3) for lease in leases}
    assert emitter.emit(running, [step_output(j, [5, 6], "ab") for j in jobs]) == ([], [])  # 3 STEP calls
    with pytest.raises(ValueError, match="one partition"):
        emitter.step_call(Emitter.writes_for(running, [step_output(j, [7], "c") for j in jobs]))
    for job_id in jobs:
        assert job_record(rclient, job_id).get("text") == "ab"
    other = _reader(rclient, partitioned, "other")
    reclaimed: list[Lease] = []  # idle past claim_timeout_s: every partition's entry is reclaimed
    wait_until(lambda: reclaimed.extend(other.pull(NUM_PARTITIONS)) or len(reclaimed) == NUM_PARTITIONS,
               timeout_s=5, what="the reclaims")  # fmt: skip
    assert sorted(lease.job_id for lease in reclaimed) == sorted(jobs)
    assert {lease.resumed_text for lease in reclaimed} == {"ab"}
    heartbeat.beat()
    assert heartbeat.take_lost() == set(jobs)  # the old attempt is out, in every partition
    for lease in reclaimed:
        assert other.hand_back(lease) == "ok"
        job = job_record(rclient, lease.job_id)
        assert job["status"] == "queued"
        assert rclient.xlen(keys.queue_stream(lease.priority, lease.partition)) == 1


def test_dead_letters_of_every_partition_are_listed_retried_and_purged(
    rclient: redis.Redis, partitioned: ServiceSettings
) -> None:
    partitioned.max_deliveries = 1
    jobs = [submit_job(rclient, partitioned, partition=p) for p in range(NUM_PARTITIONS)]
    assert len(_reader(rclient, partitioned, "dying").pull(NUM_PARTITIONS)) == NUM_PARTITIONS
    taker = _reader(rclient, partitioned, "taker")

    def all_dead() -> bool:
        assert taker.pull(NUM_PARTITIONS) == []  # past max_deliveries: each to its partition's dead letters
        return all(rclient.hget(keys.job_hash(j), "status") == "failed" for j in jobs)

    wait_until(all_dead, timeout_s=5, what="the reclaims to dead-letter every job")
    for job_id in jobs:
        assert rclient.xrange(keys.dead_letter_stream(keys.partition_of(job_id)))[0][1]["id"] == job_id
    letters = DeadLetters(rclient, partitioned)
    assert sorted(letter.job_id for letter in letters.list()) == sorted(jobs)
    assert letters.retry(jobs[2]) == "ok"
    assert rclient.hget(keys.job_hash(jobs[2]), "status") == "queued"
    assert [lease.job_id for lease in taker.pull(NUM_PARTITIONS)] == [jobs[2]]
    assert letters.purge() == NUM_PARTITIONS - 1
    assert letters.list() == []
