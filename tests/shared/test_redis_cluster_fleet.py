"""The fleet on a real 3-master Redis Cluster: a worker loop (tiny model) and the gateway over HTTP, with
`REDIS_URL=redis+cluster://...`, with one partition and with 3 (settings.redis_partitions). Every script runs on
one slot (its partition's hash tag, shared/keys.py); with 3 partitions the tenants' keys spread over more than one
master. SSE streaming and the workers' wake-ups ride cluster pub/sub."""

import json
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import pytest
import redis

from shared import keys
from shared import redis_url as redis_urls
from shared.client import FleetClient
from shared.redis_server import RedisServer
from shared.redis_topologies import LocalCluster
from shared.settings import ServiceSettings
from tests.helpers.engine_worker import EngineThread
from tests.helpers.gateway import ThreadedGateway
from tests.helpers.redis_fixtures import FAST_TIMINGS, tenant_keys
from tests.helpers.tasks import CeleryWorker
from tests.helpers.waiting import job_finished, wait_until

SHORT = {"prompt": "hello", "max_tokens": 8, "temperature": 0}
LONG = {"prompt": "hello", "max_tokens": 400, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    with LocalCluster(tmp_path_factory.mktemp("cluster")) as running:
        yield running


@pytest.fixture(scope="module", params=[1, 3], ids=["1-partition", "3-partitions"])
def num_partitions(request: pytest.FixtureRequest) -> int:
    return int(request.param)


@pytest.fixture(scope="module")
def cluster_fleet(
    cluster: LocalCluster, num_partitions: int, tiny_target: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[FleetClient, redis.Redis]]:
    settings = ServiceSettings(
        redis_url=cluster.url, redis_dir=tmp_path_factory.mktemp("worker"), redis_partitions=num_partitions,
        **FAST_TIMINGS,  # type: ignore[arg-type]
    )  # fmt: skip
    client = redis_urls.client(cluster.url, decode_responses=True)
    client.flushall(target_nodes=redis.cluster.RedisCluster.PRIMARIES)  # the other partition count's data
    broker = RedisServer(tmp_path_factory.mktemp("broker"), appendonly=False).start()
    settings.celery_broker_url = broker.url  # kombu has no Cluster transport: Celery's broker stands alone
    celery = CeleryWorker(settings, tmp_path_factory.mktemp("celery") / "celery.log").start()
    worker = EngineThread(settings, tiny_target, worker_id="cluster-w1", model_name="tiny", max_num_seqs=4).start()
    gateway = ThreadedGateway(settings).start()
    wait_until(lambda: client.zscore(keys.WORKERS_ZSET, "cluster-w1") is not None, timeout_s=120,
               what="the worker to heartbeat")
    try:
        with FleetClient(gateway.url, api_key=gateway.api_key) as fleet:
            yield fleet, client
    finally:
        gateway.stop()
        worker.stop()
        celery.stop()
        broker.stop()
        client.close()


_finished = partial(job_finished, timeout_s=120)


def test_the_fleet_keys_spread_over_no_more_than_one_slot_but_the_cluster_has_three_masters(
    cluster_fleet: tuple[FleetClient, redis.Redis], num_partitions: int
) -> None:
    """One partition: the whole fleet in one slot. Several: each job's keys, its queue and its outbox in the slot
    of its partition (its tenant's)."""
    fleet, client = cluster_fleet
    assert isinstance(client, redis.cluster.RedisCluster) and len(client.get_primaries()) == 3
    job_id = fleet.submit(SHORT)["id"]
    _finished(fleet, job_id)
    partition = keys.partition_of(job_id)
    assert num_partitions > 1 or partition == 0
    global_keys = (keys.WORKERS_ZSET,) if num_partitions == 1 else ()
    slots = {client.keyslot(k) for k in (keys.job_hash(job_id), keys.job_events(job_id),
                                        keys.queue_stream("default", partition), keys.outbox_stream(partition),
                                        *global_keys)}  # fmt: skip
    assert len(slots) == 1


def test_the_partitions_spread_the_tenants_over_the_masters(
    cluster_fleet: tuple[FleetClient, redis.Redis], num_partitions: int, cluster: LocalCluster
) -> None:
    """A tenant in each partition: every one's jobs complete; with 3 partitions their slots are served by at least
    two masters, and keys really landed on more than one node."""
    fleet, client = cluster_fleet
    job_ids = []
    for key, secret in tenant_keys(cluster.url, num_partitions):
        with FleetClient(str(fleet.http.base_url), api_key=secret) as tenant:
            job_id = tenant.submit(SHORT)["id"]
            assert keys.partition_of(job_id) == keys.partition_of(key.id)
            assert _finished(tenant, job_id)["status"] == "succeeded"
            job_ids.append(job_id)
    assert [keys.partition_of(j) for j in job_ids] == list(range(num_partitions))
    assert isinstance(client, redis.cluster.RedisCluster)
    masters = {client.get_node_from_key(keys.prefix(p)).name for p in range(num_partitions)}  # type: ignore[union-attr]
    for partition in range(num_partitions):
        slot = client.keyslot(keys.prefix(partition))
        node = client.get_node_from_key(keys.prefix(partition))
        assert client.cluster_countkeysinslot(slot) > 0, partition  # type: ignore[no-untyped-call]
        assert client.exists(keys.job_hash(job_ids[partition])) and node is not None
    sizes = {node.name: int(client.dbsize(target_nodes=node)) for node in client.get_primaries()}  # type: ignore[call-arg]
    nodes_with_keys = [name for name, size in sizes.items() if size > 0]
    if num_partitions == 1:
        assert len(masters) == 1 and len(nodes_with_keys) == 1
    else:
        assert len(masters) >= 2 and len(nodes_with_keys) >= 2, (masters, sizes)


def test_submit_poll_and_stream_match_on_a_cluster(cluster_fleet: tuple[FleetClient, redis.Redis]) -> None:
    fleet, client = cluster_fleet
    job_id = fleet.submit({**SHORT, "priority": "interactive"})["id"]
    events = list(fleet.stream(job_id))  # the gateway's hub: cluster pub/sub wake-ups + the event stream
    job = _finished(fleet, job_id)
    assert job["status"] == "succeeded" and events[-1].event == "done"
    assert [t for e in events if e.event == "token" for t in e.data["token_ids"]] == job["output"]["token_ids"]
    assert len(job["output"]["token_ids"]) == SHORT["max_tokens"]
    assert client.hget(keys.job_hash(job_id), "attempt") == "1"
    assert fleet.http.get("/readyz").status_code == 200
    metrics = fleet.http.get("/metrics")  # the queue gauges: pipelines over every partition's streams, by slot
    assert metrics.status_code == 200
    assert 'specfleet_queue_oldest_age_seconds{priority="interactive"} 0.0' in metrics.text


def test_idempotent_submit_priorities_and_cancel_on_a_cluster(cluster_fleet: tuple[FleetClient, redis.Redis]) -> None:
    fleet, _ = cluster_fleet
    first = fleet.submit(SHORT, idempotency_key="same")["id"]
    assert fleet.submit(SHORT, idempotency_key="same")["id"] == first
    running = fleet.submit(LONG)["id"]
    wait_until(lambda: fleet.get(running)["usage"]["completion_tokens"] > 0, timeout_s=120,
               what="the long job to produce tokens")
    assert fleet.cancel(running)["status"] == "cancelled"  # the cancel channel reaches the worker
    batch = fleet.submit({**SHORT, "priority": "batch"})["id"]
    jobs = [_finished(fleet, job_id) for job_id in (first, running, batch)]
    assert [job["status"] for job in jobs] == ["succeeded", "cancelled", "succeeded"]
    assert jobs[1]["usage"]["completion_tokens"] < LONG["max_tokens"]


def test_a_batch_runs_with_celery_on_its_own_broker(
    cluster_fleet: tuple[FleetClient, redis.Redis], tmp_path: Path
) -> None:
    fleet, _ = cluster_fleet
    lines = [{"custom_id": f"line-{i}", "method": "POST", "url": "/v1/jobs", "body": {**SHORT, "max_tokens": 4}}
             for i in range(3)]
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    batch_id = fleet.submit_batch(path)["id"]
    batch = wait_until(
        lambda: (b := fleet.get_batch(batch_id))["status"] in ("completed", "failed", "cancelled") and b,
        timeout_s=120,
        interval_s=0.05,
        what="the batch to finish",
    )
    assert batch["status"] == "completed" and batch["request_counts"] == {"total": 3, "completed": 3, "failed": 0}
