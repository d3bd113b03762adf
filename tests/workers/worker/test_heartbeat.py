"""Heartbeats keep a held job from being reclaimed, mark the worker alive, and report jobs lost."""

import os
import time

import redis

from shared import cpu_placement, keys
from shared.settings import ServiceSettings
from tests.helpers.cpus import ALLOWED, cores_of, needs_two_cores
from tests.helpers.redis_fixtures import submit_job
from tests.helpers.waiting import wait_until
from workers.worker.heartbeat import Heartbeat
from workers.worker.queue_reader import QueueReader


def test_heartbeat_prevents_reclaim(rclient: redis.Redis, settings: ServiceSettings) -> None:
    job_id = submit_job(rclient, settings)
    holder = QueueReader(rclient, settings, "holder")
    holder.ensure_groups()
    leases = holder.pull(1)
    heartbeat = Heartbeat(rclient, settings, "holder", lambda: leases)
    heartbeat.start()
    other = QueueReader(rclient, settings, "other")
    try:
        deadline = time.monotonic() + 2.5 * settings.claim_timeout_s
        while time.monotonic() < deadline:
            assert other.pull(1) == []  # reclaim runs on every pull that is reclaim_interval_s apart
            time.sleep(0.05)
        assert rclient.zscore(keys.WORKERS_ZSET, "holder") is not None
    finally:
        heartbeat.stop()
    assert rclient.zscore(keys.WORKERS_ZSET, "holder") is None
    assert rclient.hget(keys.job_hash(job_id), "worker") == "holder"
    assert (
        wait_until(lambda: other.pull(1), timeout_s=5, what="the reclaim once beats stop")[0].job_id == job_id
    )


def test_heartbeat_reports_lost_jobs(rclient: redis.Redis, settings: ServiceSettings) -> None:
    kept, cancelled = submit_job(rclient, settings), submit_job(rclient, settings)
    reader = QueueReader(rclient, settings, "w1")
    reader.ensure_groups()
    leases = reader.pull(2)
    rclient.hset(keys.job_hash(cancelled), "status", "cancelled")
    heartbeat = Heartbeat(rclient, settings, "w1", lambda: leases)
    heartbeat.beat()
    assert heartbeat.take_lost() == {cancelled}
    assert heartbeat.take_lost() == set()
    assert rclient.hget(keys.job_hash(kept), "status") == "running"


@needs_two_cores
def test_the_heartbeat_thread_runs_on_the_io_cores(rclient: redis.Redis, settings: ServiceSettings) -> None:
    io_cpus = frozenset({min(ALLOWED)})
    heartbeat = Heartbeat(rclient, settings, "w1", list, cpus=io_cpus)
    with cpu_placement.bound(ALLOWED - io_cpus):  # started by the worker's main thread, on its engine cores
        heartbeat.start()
    try:
        assert heartbeat.native_id is not None
        wait_until(lambda: cores_of(os.getpid(), heartbeat.native_id) == io_cpus, what="the thread to bind itself")
        assert os.sched_getaffinity(0) == ALLOWED  # the caller's own cores are untouched
        wait_until(lambda: rclient.zscore(keys.WORKERS_ZSET, "w1"), timeout_s=5, what="a beat from there")
    finally:
        heartbeat.stop()
