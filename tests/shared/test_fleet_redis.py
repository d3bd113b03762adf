"""The fleet's private redis-server, supervised: one that exits is started again on its port and data directory
(what the AOF holds survives), and one that keeps exiting stops the fleet with its log's tail."""

import signal
from pathlib import Path

import pytest
import redis

from shared import fleet as fleet_module
from shared.fleet import Fleet


def _kill(fleet: Fleet) -> None:
    assert fleet.redis_server is not None and fleet.redis_server.process is not None
    fleet.redis_server.process.send_signal(signal.SIGKILL)
    fleet.redis_server.process.wait()


def test_a_private_redis_that_exits_is_started_again_with_its_data(tmp_path: Path) -> None:
    with Fleet(tmp_path / "redis") as fleet:
        url = fleet.start_redis()
        with redis.Redis.from_url(url, decode_responses=True) as client:
            client.config_set("appendfsync", "always")  # on disk before SET answers, not within the next second
            client.set("job", "kept")
        _kill(fleet)
        fleet.check_children()  # no RuntimeError: started again
        assert fleet.redis_url == url
        with redis.Redis.from_url(url, decode_responses=True) as client:
            assert client.get("job") == "kept"


def test_a_private_redis_that_keeps_exiting_stops_the_fleet(tmp_path: Path) -> None:
    with Fleet(tmp_path / "redis") as fleet:
        fleet.start_redis()
        for _ in range(fleet_module.REDIS_RESTARTS_MAX):
            _kill(fleet)
            fleet.check_children()
        _kill(fleet)
        with pytest.raises(RuntimeError, match=r"exited 4 times within 60 s \(last status -9\)"):
            fleet.check_children()
