"""API key records: made random, stored as a hash, listed without secrets, revoked by id (real Redis)."""

import pytest
import redis

from shared import keys
from shared.api_keys import ApiKey, KeyRegistry, digest, looks_like_key, webhook_secret_of


def test_a_key_is_stored_only_as_its_digest(rclient: redis.Redis) -> None:
    registry = KeyRegistry(rclient)
    key, secret = registry.create("acme", requests_per_min=5, tokens_per_min=100, max_concurrent_jobs=2)
    other_secret = registry.create("other", requests_per_min=0, tokens_per_min=0, max_concurrent_jobs=0)[1]
    assert looks_like_key(secret) and secret != other_secret and len(secret) > 40
    assert not looks_like_key("sk-" + secret[3:]) and not looks_like_key(secret + "é")
    stored = rclient.hgetall(keys.api_key_record(digest(secret), keys.partition_of(key.id)))
    assert ApiKey.from_fields(stored) == key and secret not in str(stored)
    assert rclient.hget(keys.API_KEYS_INDEX, key.id) == digest(secret)
    assert "webhook_secret" not in key.public() and key.webhook_secret.startswith("whsec_")


def test_list_and_revoke(rclient: redis.Redis) -> None:
    registry = KeyRegistry(rclient)
    first, _ = registry.create(
        "a", requests_per_min=1, tokens_per_min=1, max_concurrent_jobs=1, is_admin=True
    )
    second, _ = registry.create("b", requests_per_min=1, tokens_per_min=1, max_concurrent_jobs=1)
    assert [k.name for k in registry.list()] == ["a", "b"] and registry.list()[0].is_admin
    assert registry.num_active() == 2
    assert registry.revoke(second.id) and not registry.revoke("key_nope")
    assert registry.num_active() == 1 and registry.list()[1].revoked_at is not None


def test_a_create_cut_between_its_two_steps_leaves_no_key_and_no_partial_record(rclient: redis.Redis) -> None:
    """create() writes the global index first, then the record (two slots with partitions): a crash between
    them leaves an index entry alone, which the listing skips and revoking refuses without writing a record."""
    registry = KeyRegistry(rclient, num_partitions=3)
    kept, _ = registry.create("kept", requests_per_min=1, tokens_per_min=1, max_concurrent_jobs=1)
    cut, secret = registry.create("cut", requests_per_min=1, tokens_per_min=1, max_concurrent_jobs=1)
    record = keys.api_key_record(digest(secret), keys.partition_of(cut.id))
    rclient.delete(record)  # as if the process died after the index's HSET
    assert [k.id for k in registry.list()] == [kept.id] and registry.num_active() == 1
    assert not registry.revoke(cut.id) and not rclient.exists(record)
    assert registry.revoke(kept.id) and not registry.list()[0].is_active


def test_webhook_secret_of_the_owner(rclient: redis.Redis) -> None:
    key, _ = KeyRegistry(rclient).create(
        "hooks", requests_per_min=0, tokens_per_min=0, max_concurrent_jobs=0, webhook_secret="whsec_AAAA"
    )
    rclient.hset(keys.job_hash("j1"), keys.OWNER_FIELD, key.id)
    rclient.hset(keys.job_hash("j2"), "status", "queued")
    assert webhook_secret_of(rclient, keys.job_hash("j1")) == "whsec_AAAA"
    assert webhook_secret_of(rclient, keys.job_hash("j2")) is None


@pytest.mark.parametrize(
    ("name", "limits", "webhook_secret", "reason"),
    [
        ("", (1, 1, 1), None, "name"),
        ("   ", (1, 1, 1), None, "name"),
        ("x" * 129, (1, 1, 1), None, "name"),
        ("neg", (-1, 1, 1), None, "limit"),  # read as no limit at all
        ("neg", (1, 1, -5), None, "limit"),
        ("hook", (1, 1, 1), "abc", "whsec_"),  # every webhook of its jobs failed at signing
        ("hook", (1, 1, 1), "whsec_not base64!", "base64"),
        ("hook", (1, 1, 1), "whsec_", "one byte"),
    ],
)
def test_a_key_that_would_work_badly_is_not_made(
    rclient: redis.Redis, name: str, limits: tuple[int, int, int], webhook_secret: str | None, reason: str
) -> None:
    requests_per_min, tokens_per_min, max_concurrent_jobs = limits
    with pytest.raises(ValueError, match=reason):
        KeyRegistry(rclient).create(name, requests_per_min=requests_per_min, tokens_per_min=tokens_per_min,
                                    max_concurrent_jobs=max_concurrent_jobs, webhook_secret=webhook_secret)  # fmt: skip
    assert rclient.hlen(keys.API_KEYS_INDEX) == 0
