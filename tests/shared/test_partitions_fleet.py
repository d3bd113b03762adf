"""One fleet over 3 hash-tag partitions (settings.redis_partitions, shared/keys.py) on a standalone Redis: a worker
loop (tiny model), the gateway over HTTP and a Celery worker, with one tenant in each partition. Every tenant's
jobs, batches and idempotency keys live in its own partition; the worker pulls from all of them, the outbox
bridges read every partition's outbox."""

import json
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import pytest
import redis

from shared import keys, lua
from shared import redis_url as redis_urls
from shared.api_keys import ApiKey, digest
from shared.client import FleetClient
from shared.redis_server import RedisServer
from shared.schemas import JobRequest
from shared.settings import ServiceSettings
from shared.submit import new_job_id, partition_for, submit_call
from tests.helpers.engine_worker import EngineThread
from tests.helpers.gateway import ThreadedGateway
from tests.helpers.redis_fixtures import FAST_TIMINGS, tenant_keys
from tests.helpers.tasks import LOOPBACK, CeleryWorker
from tests.helpers.waiting import job_finished, wait_until

NUM_PARTITIONS = 3
SHORT = {"prompt": "hello", "max_tokens": 6, "temperature": 0}
LONG = {"prompt": "hello", "max_tokens": 400, "temperature": 0, "ignore_eos": True}
# a job the Celery side acts on at its end (its `completed` notice): the delivery is refused (nothing listens there)
HOOKED = {"webhook": "http://127.0.0.1:9/hook", "webhook_events_filter": ["completed"]}

_finished = partial(job_finished, timeout_s=120)


@dataclass
class Tenant:
    key: ApiKey
    fleet: FleetClient
    partition: int


@dataclass
class PartitionedFleet:
    settings: ServiceSettings
    client: redis.Redis
    admin: FleetClient
    tenants: list[Tenant]  # one per partition, by partition


@pytest.fixture(scope="module")
def partitioned(tiny_target: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PartitionedFleet]:
    server = RedisServer(tmp_path_factory.mktemp("redis"), appendonly=False).start()
    settings = ServiceSettings(
        redis_url=server.url, redis_dir=tmp_path_factory.mktemp("worker"), redis_partitions=NUM_PARTITIONS,
        webhook_allow_hosts=LOOPBACK, **FAST_TIMINGS,  # type: ignore[arg-type]
    )  # fmt: skip
    celery = CeleryWorker(settings, tmp_path_factory.mktemp("celery") / "celery.log").start()
    worker = EngineThread(settings, tiny_target, worker_id="part-w1", model_name="tiny", max_num_seqs=4).start()
    gateway = ThreadedGateway(settings).start()
    client = redis_urls.client(server.url, decode_responses=True)
    wait_until(lambda: client.zscore(keys.WORKERS_ZSET, "part-w1") is not None, timeout_s=120,
               what="the worker to heartbeat")  # fmt: skip
    tenants = []
    for key, secret in tenant_keys(server.url, NUM_PARTITIONS):
        assert keys.partition_of(key.id) == keys.tenant_partition(digest(secret), NUM_PARTITIONS)
        tenants.append(Tenant(key, FleetClient(gateway.url, api_key=secret), keys.partition_of(key.id)))
    try:
        with FleetClient(gateway.url, api_key=gateway.api_key) as admin:
            yield PartitionedFleet(settings, client, admin, tenants)
    finally:
        for tenant in tenants:
            tenant.fleet.close()
        gateway.stop()
        worker.stop()
        celery.stop()
        client.close()
        server.stop()


def test_every_tenant_jobs_live_in_its_partition_and_complete(partitioned: PartitionedFleet) -> None:
    fleet = partitioned
    assert [t.partition for t in fleet.tenants] == list(range(NUM_PARTITIONS))
    job_ids = [t.fleet.submit({**SHORT, "priority": priority, **(HOOKED if priority == "batch" else {})})["id"]
               for t in fleet.tenants for priority in ("interactive", "default", "batch")]  # fmt: skip
    for tenant in fleet.tenants:
        for job_id in job_ids:
            if keys.partition_of(job_id) == tenant.partition:
                job = _finished(tenant.fleet, job_id)
                assert job["status"] == "succeeded" and len(job["output"]["token_ids"]) == SHORT["max_tokens"]
    assert [keys.partition_of(j) for j in job_ids] == [p for p in range(NUM_PARTITIONS) for _ in range(3)]
    for job_id in job_ids:
        partition = keys.partition_of(job_id)
        assert keys.job_hash(job_id).startswith(keys.prefix(partition))
        assert fleet.client.hget(keys.job_hash(job_id), "status") == "succeeded"
        assert fleet.client.xlen(keys.job_events(job_id)) > 0
    # the outbox of every partition got its webhook job's `completed` notice (the plain jobs none), and the bridges
    # read them all
    for partition in range(NUM_PARTITIONS):
        noticed = [f["id"] for _, f in fleet.client.xrange(keys.outbox_stream(partition)) if f["event"] == "completed"]
        assert noticed == [job_ids[3 * partition + 2]]
        wait_until(lambda p=partition: _outbox_drained(fleet.client, p), timeout_s=30, what="the bridges to read")
    # a tenant sees only its own jobs, wherever they are
    other = job_ids[-1]
    assert fleet.tenants[0].fleet.http.get(f"/v1/jobs/{other}").status_code == 404
    assert fleet.admin.get(other)["status"] == "succeeded"
    assert fleet.admin.http.get("/readyz").json()["queue_depth"] == {"interactive": 0, "default": 0, "batch": 0}


def _outbox_drained(client: redis.Redis, partition: int) -> bool:
    """Every notice of the partition's outbox was read by a bridge and acked."""
    stream = keys.outbox_stream(partition)
    group = next(g for g in client.xinfo_groups(stream) if g["name"] == keys.OUTBOX_GROUP)
    newest = client.xrevrange(stream, count=1)
    return bool(newest) and group["pending"] == 0 and group["last-delivered-id"] == newest[0][0]


def test_idempotency_dedupes_within_a_tenant_partition(partitioned: PartitionedFleet) -> None:
    for tenant in partitioned.tenants:
        first = tenant.fleet.submit(SHORT, idempotency_key="same-key")["id"]
        assert tenant.fleet.submit(SHORT, idempotency_key="same-key")["id"] == first
        assert keys.partition_of(first) == tenant.partition
    firsts = {t.fleet.submit(SHORT, idempotency_key="same-key")["id"] for t in partitioned.tenants}
    assert len(firsts) == NUM_PARTITIONS  # one tenant's key never finds another tenant's job
    for tenant in partitioned.tenants:
        assert _finished(tenant.fleet, tenant.fleet.submit(SHORT, idempotency_key="same-key")["id"])["status"] == (
            "succeeded"
        )


def test_without_a_tenant_the_idempotency_key_picks_the_partition(partitioned: PartitionedFleet) -> None:
    """The SUBMIT script without a key (batch lines, the benchmarks): the same Idempotency-Key, the same
    partition, the same job."""
    settings, client = partitioned.settings, partitioned.client
    script = client.register_script(lua.SUBMIT)
    request = JobRequest.model_validate(SHORT)
    answers = []
    for _ in range(2):
        partition = partition_for("no-tenant-key", settings)
        keys_, args = submit_call(request, new_job_id(partition), "no-tenant-key", settings)
        answers.append(script(keys=keys_, args=args))
    assert answers[0][0] == "ok" and answers[1][0] == "dup" and answers[1][1] == answers[0][1]
    assert keys.partition_of(answers[0][1]) == keys.spread("no-tenant-key", NUM_PARTITIONS)
    assert _finished(partitioned.admin, answers[0][1])["status"] == "succeeded"


def test_cancel_reaches_a_running_job_of_every_partition(partitioned: PartitionedFleet) -> None:
    running = [t.fleet.submit(LONG)["id"] for t in partitioned.tenants]
    for tenant, job_id in zip(partitioned.tenants, running, strict=True):
        wait_until(lambda f=tenant.fleet, j=job_id: f.get(j)["usage"]["completion_tokens"] > 0, timeout_s=120,
                   what="the long job to produce tokens")  # fmt: skip
        assert tenant.fleet.cancel(job_id)["status"] == "cancelled"
    for tenant, job_id in zip(partitioned.tenants, running, strict=True):
        job = _finished(tenant.fleet, job_id)
        assert job["status"] == "cancelled" and job["usage"]["completion_tokens"] < LONG["max_tokens"]


def test_a_batch_of_every_partition_completes_through_celery(
    partitioned: PartitionedFleet, tmp_path: Path
) -> None:
    lines = [{"custom_id": f"line-{i}", "method": "POST", "url": "/v1/jobs", "body": {**SHORT, "max_tokens": 4}}
             for i in range(3)]  # fmt: skip
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    batch_ids = [t.fleet.submit_batch(path)["id"] for t in partitioned.tenants]
    assert [keys.partition_of(b) for b in batch_ids] == list(range(NUM_PARTITIONS))
    for tenant, batch_id in zip(partitioned.tenants, batch_ids, strict=True):
        batch = wait_until(
            lambda f=tenant.fleet, b=batch_id: (x := f.get_batch(b))["status"] in ("completed", "failed") and x,
            timeout_s=120,
            interval_s=0.05,
            what="the batch to finish",
        )
        assert batch["status"] == "completed" and batch["request_counts"] == {"total": 3, "completed": 3, "failed": 0}
        line_jobs = partitioned.client.hvals(keys.batch_jobs(batch_id))
        assert len(line_jobs) == 3 and {keys.partition_of(j) for j in line_jobs} == {tenant.partition}
        assert [tenant.fleet.list_batches()["data"][0]["id"]] == [batch_id]  # the tenant's own listing
    listed = {b["id"] for b in partitioned.admin.list_batches(limit=100)["data"]}
    assert set(batch_ids) <= listed  # the admin's listing is global


def test_files_and_batch_output_files_live_in_their_tenant_partition(
    partitioned: PartitionedFleet, tmp_path: Path
) -> None:
    line = {"custom_id": "only", "method": "POST", "url": "/v1/jobs", "body": {**SHORT, "max_tokens": 3}}
    content = (json.dumps(line) + "\n").encode()
    file_ids = []
    for tenant in partitioned.tenants:
        files = {"file": ("in.jsonl", content, "application/jsonl")}
        created = tenant.fleet.http.post("/v1/files", files=files, data={"purpose": "batch"})
        assert created.status_code == 200, created.text
        file_id = created.json()["id"]
        assert keys.partition_of(file_id) == tenant.partition
        assert partitioned.client.exists(keys.file_hash(file_id), keys.file_content(file_id)) == 2
        assert tenant.fleet.http.get(f"/v1/files/{file_id}/content").content == content
        assert [f["id"] for f in tenant.fleet.http.get("/v1/files?purpose=batch").json()["data"]] == [file_id]
        file_ids.append(file_id)
    assert set(file_ids) <= {f["id"] for f in partitioned.admin.http.get("/v1/files?limit=100").json()["data"]}
    last = partitioned.tenants[-1]
    assert partitioned.tenants[0].fleet.http.get(f"/v1/files/{file_ids[-1]}").status_code == 404  # not its own
    batch_id = last.fleet.submit_batch(_jsonl(tmp_path, [line]))["id"]
    batch = wait_until(lambda: (b := last.fleet.get_batch(batch_id))["status"] == "completed" and b, timeout_s=120,
                       interval_s=0.05, what="the batch to finish")  # fmt: skip
    output = last.fleet.http.get(f"/v1/files/{batch['output_file_id']}/content")
    assert output.status_code == 200 and json.loads(output.text)["custom_id"] == "only"
    outputs = [f["id"] for f in last.fleet.http.get("/v1/files?purpose=batch_output").json()["data"]]
    assert batch["output_file_id"] in outputs  # listed by the script that ended it, in the tenant's partition
    admin_listed = wait_until(lambda: {f["id"] for f in partitioned.admin.http.get("/v1/files?limit=100").json()["data"]}
                              & {batch["output_file_id"]}, what="the admin's listing")  # fmt: skip
    assert admin_listed == {batch["output_file_id"]}
    assert keys.partition_of(batch_id) == last.partition  # its files' listing: the tenant's partition
    assert last.fleet.http.delete(f"/v1/files/{file_ids[-1]}").json()["deleted"] is True
    assert not partitioned.client.exists(keys.file_hash(file_ids[-1]))
    assert file_ids[-1] not in {f["id"] for f in partitioned.admin.http.get("/v1/files?limit=100").json()["data"]}


def _jsonl(folder: Path, lines: list[dict[str, object]]) -> Path:
    path = folder / "lines.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path
