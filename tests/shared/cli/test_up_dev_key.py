"""`specfleet up` (dev): the admin key it prints is the last run's while its Redis still holds it."""

import stat
from pathlib import Path

import redis

from shared.api_keys import KeyRegistry
from shared.cli.up import DEV_KEY_FILE, Up
from shared.settings import ServiceSettings


def test_a_restart_prints_the_same_dev_key_until_it_is_revoked(redis_url: str, rclient: redis.Redis, tmp_path: Path) -> None:
    """Each run minted another admin key and the earlier ones stayed valid (three "dev" keys after three runs)."""
    up = Up(settings=ServiceSettings(redis_url=redis_url, redis_dir=tmp_path / "redis"))
    first = up._dev_key(redis_url)
    assert up._dev_key(redis_url) == first
    kept = tmp_path / "redis" / DEV_KEY_FILE
    assert kept.read_text().strip() == first and stat.S_IMODE(kept.stat().st_mode) == 0o600
    registry = KeyRegistry(rclient)
    (dev,) = [key for key in registry.list() if key.name == "dev"]
    assert dev.is_admin
    registry.revoke(dev.id)
    second = up._dev_key(redis_url)  # revoked: a new one, kept instead
    assert second != first and kept.read_text().strip() == second
    assert [key.is_active for key in registry.list() if key.name == "dev"] == [False, True]
    rclient.flushall()  # another Redis (its data gone): a new one too
    assert up._dev_key(redis_url) not in (first, second)
