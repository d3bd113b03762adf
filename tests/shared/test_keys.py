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


def test_every_key_shares_the_fleet_hash_tag() -> None:
    """Redis Cluster: the scripts touch a job's keys, its queue, the outbox and the limits together, so every key
    must hash to one slot."""
    samples = [keys.job_hash("j1"), keys.job_events("j1"), keys.queue_stream("batch"), keys.idempotency("k"),
               keys.OUTBOX_STREAM, keys.DEAD_LETTER_STREAM, keys.WORKERS_ZSET, keys.batch_lines("b"),
               keys.rate_limit_state("k1"), keys.inflight_jobs("k1"), keys.api_key_record("d"), keys.CELERY_KEY_PREFIX]
    assert {key.split("}")[0] + "}" for key in samples} == {"{" + keys.NAMESPACE + "}"}


def test_no_key_of_the_module_escapes_the_hash_tag() -> None:
    """Every key constant and every key function of shared/keys.py, not a sample: a key added later (files,
    quotas) must join the tag too, or a Cluster refuses the MULTI or script that touches it with others."""
    import inspect

    not_keys = {"NAMESPACE", "PREFIX", "CONSUMER_GROUP", "EVENTS_SUFFIX", "OUTBOX_GROUP", "CELERY_QUEUE",
                "WEBHOOK_FIELD_PREFIX", "OWNER_FIELD", "batch_line_idempotency"}  # names and fields, not keys
    names = [n for n in dir(keys) if not n.startswith("_") and n not in not_keys]
    constants = [getattr(keys, n) for n in names if n.isupper() and isinstance(getattr(keys, n), str)]
    functions = [getattr(keys, n) for n in names if inspect.isfunction(getattr(keys, n))]
    made = [f(*["x"] * len(inspect.signature(f).parameters)) for f in functions]
    assert len(constants) >= 15 and len(made) >= 15
    assert [k for k in constants + made if not k.startswith(keys.PREFIX)] == []
