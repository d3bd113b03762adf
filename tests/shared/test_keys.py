"""Every Redis key string lives in shared/keys.py: no other source file spells the namespace."""

import re
from pathlib import Path

from shared import keys

ROOT = Path(__file__).resolve().parents[2]
KEY_LITERAL = re.compile(rf"[\"']\{{?{keys.NAMESPACE}\}}?:[a-z{{]")  # "{specfleet}:job:..." (not "specfleet: help")


def test_no_key_strings_outside_keys_module() -> None:
    offenders = []
    for folder in ("shared", "gateway", "workers", "tests"):  # tests too: a test on a stale key name waits forever
        for path in (ROOT / folder).rglob("*.py"):
            if path != ROOT / "shared" / "keys.py" and path != Path(__file__) and KEY_LITERAL.search(path.read_text()):
                offenders.append(str(path.relative_to(ROOT)))
    assert offenders == []


def test_key_layout() -> None:
    assert keys.job_events("j1") == keys.job_hash("j1") + keys.EVENTS_SUFFIX
    assert keys.job_channel("j1").startswith(keys.CHANNEL_PREFIX)
    assert len({keys.queue_stream(p) for p in ("interactive", "default", "batch")}) == 3


def test_every_key_shares_the_fleet_hash_tag() -> None:  # with one partition, the default
    """Redis Cluster: the scripts touch a job's keys, its queue, the outbox and the limits together, so every key
    must hash to one slot."""
    samples = [keys.job_hash("j1"), keys.job_events("j1"), keys.queue_stream("batch"), keys.idempotency("k"),
               keys.OUTBOX_STREAM, keys.DEAD_LETTER_STREAM, keys.WORKERS_ZSET, keys.batch_lines("b"),
               keys.rate_limit_state("k1"), keys.inflight_jobs("k1"), keys.api_key_record("d", 0), keys.CELERY_KEY_PREFIX]
    assert {key.split("}")[0] + "}" for key in samples} == {"{" + keys.NAMESPACE + "}"}


def test_no_key_of_the_module_escapes_the_hash_tag() -> None:
    """Every key constant and every key function of shared/keys.py, not a sample: a key added later (files,
    quotas) must join the tag too, or a Cluster refuses the MULTI or script that touches it with others."""
    import inspect

    not_keys = {"NAMESPACE", "PREFIX", "CONSUMER_GROUP", "EVENTS_SUFFIX", "OUTPUT_TEXT_SUFFIX", "OUTPUT_IDS_SUFFIX",
                "OUTBOX_GROUP", "CELERY_QUEUE",
                "WEBHOOK_FIELD_PREFIX", "OWNER_FIELD", "RESPONSE_FIELD", "batch_line_idempotency", "PARTITION_MARK",
                "mark", "partition_of", "by_partition", "spread", "tenant_partition", "prefix"}  # names, fields, partitions
    names = [n for n in dir(keys) if not n.startswith("_") and n not in not_keys]
    constants = [getattr(keys, n) for n in names if n.isupper() and isinstance(getattr(keys, n), str)]
    functions = [getattr(keys, n) for n in names if inspect.isfunction(getattr(keys, n))]
    made = [f(*_arguments(f, "x", 0)) for f in functions]
    assert len(constants) >= 13 and len(made) >= 20  # the per-partition prefixes became functions
    assert [k for k in constants + made if not k.startswith(keys.PREFIX)] == []


def _arguments(function: object, text: str, partition: int) -> list[object]:
    """Arguments for a key function: `partition` for its partition parameter, `text` for every other one."""
    import inspect

    parameters = inspect.signature(function).parameters.values()  # type: ignore[arg-type]
    return [partition if p.name == "partition" else text for p in parameters]


# -- partitions (settings.redis_partitions) ------------------------------------------------------------------


def test_with_one_partition_every_key_is_byte_for_byte_what_it_was() -> None:
    """The key names before partitions (issue 17), spelled out: a fleet with N = 1 finds its data unchanged."""
    tag = "{" + keys.NAMESPACE + "}:"
    assert keys.PREFIX == tag
    assert keys.job_hash("ab12") == tag + "job:ab12"
    assert keys.job_events("ab12") == tag + "job:ab12:events"
    assert keys.job_channel("ab12") == tag + "wake:ab12"
    assert keys.queue_stream("interactive") == keys.queue_stream("interactive", 0) == tag + "jobs:interactive"
    assert keys.idempotency("k") == tag + "idem:k"
    assert keys.dead_letter_stream(0) == keys.DEAD_LETTER_STREAM == tag + "jobs:dead"
    assert keys.outbox_stream(0) == keys.OUTBOX_STREAM == tag + "outbox"
    assert keys.batch_hash("batch_ab") == tag + "batch:batch_ab"
    assert keys.batch_lines("batch_ab") == tag + "batch:batch_ab:lines"
    assert keys.batch_jobs("batch_ab") == tag + "batch:batch_ab:jobs"
    assert keys.batch_results("batch_ab") == tag + "batch:batch_ab:results"
    assert keys.api_key_record("d1", 0) == tag + "apikey:d1"
    assert keys.rate_limit_state("key_ab") == tag + "ratelimit:key_ab"
    assert keys.inflight_jobs("key_ab") == tag + "inflight:key_ab"
    assert keys.batches_of("key_ab") == tag + "batches:of:key_ab"
    assert keys.file_hash("file-ab") == tag + "file:file-ab"
    assert keys.file_content("file-ab") == tag + "file:file-ab:content"
    assert keys.files_of("key_ab") == tag + "files:of:key_ab"
    assert keys.job_prefix(0) == keys.JOB_PREFIX == tag + "job:"
    for digest in ("0" * 64, "f" * 64, "9a" * 32):
        assert keys.tenant_partition(digest, 1) == 0
    assert keys.spread("any idempotency key", 1) == 0


def test_a_partition_keys_carry_its_own_tag() -> None:
    """Every key function of partition p (by its partition argument or by the id it takes) starts {specfleet:p}."""
    import inspect

    for partition in (1, 2, 17):
        tag = keys.prefix(partition)
        assert tag == "{" + f"{keys.NAMESPACE}:{partition}" + "}:"
        marked = keys.mark("x", partition)
        key_functions = [getattr(keys, n) for n in ("job_hash", "job_events", "queue_stream", "idempotency",
                         "dead_letter_stream", "outbox_stream", "batch_hash", "batch_lines", "batch_jobs",
                         "batch_results", "api_key_record", "rate_limit_state", "inflight_jobs", "batches_of",
                         "file_hash", "file_content", "files_of", "job_prefix", "rate_limit_prefix",
                         "inflight_prefix")]  # fmt: skip
        made = [f(*_arguments(f, marked, partition)) for f in key_functions]
        assert [k for k in made if not k.startswith(tag)] == []
        assert all(inspect.isfunction(f) for f in key_functions)
    global_keys = [keys.WORKERS_ZSET, keys.MODEL_INFO, keys.WORKER_VERSIONS, keys.API_KEYS_INDEX, keys.BATCHES_ZSET,
                   keys.FILES_ZSET, keys.CELERY_KEY_PREFIX, keys.job_channel(keys.mark("x", 2))]
    assert all(k.startswith(keys.PREFIX) for k in global_keys)


def test_ids_round_trip_their_partition_and_old_ids_are_partition_0() -> None:
    import uuid

    for base in (uuid.uuid4().hex, f"batch_{uuid.uuid4().hex}", f"file-{uuid.uuid4().hex}", "key_0123abcd"):
        assert keys.partition_of(base) == 0  # minted before partitions, or in partition 0
        assert keys.mark(base, 0) == base
        for partition in (1, 2, 9, 123):
            assert keys.partition_of(keys.mark(base, partition)) == partition
    assert keys.mark("batch_ab12", 3) == "batch_ab12P3"  # within the routes' id patterns: letters and digits
    assert keys.partition_of("jobP0") == 0 and keys.partition_of("jobP01") == 0  # not minted marks: partition 0


def test_tenants_and_idempotency_keys_map_to_partitions_deterministically() -> None:
    import hashlib

    digests = [hashlib.sha256(f"sf-{i}".encode()).hexdigest() for i in range(200)]
    for num in (1, 2, 3, 8):
        picked = [keys.tenant_partition(d, num) for d in digests]
        assert picked == [keys.tenant_partition(d, num) for d in digests]
        assert set(picked) == set(range(num))  # 200 tenants reach every partition
        spread = [keys.spread(f"idem-{i}", num) for i in range(200)]
        assert spread == [keys.spread(f"idem-{i}", num) for i in range(200)] and set(spread) == set(range(num))
