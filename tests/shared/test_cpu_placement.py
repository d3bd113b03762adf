"""CPU placement: the CPU-list form, which cores the engine and the I/O get, the settings that choose it, and real
processes started on the cores they were given (Redis here; the worker's writer process and heartbeat in
tests/workers/worker/, the whole of `specfleet up` in tests/shared/cli/test_up.py)."""

import os
import threading
from pathlib import Path

import pydantic
import pytest
import redis

from shared import cpu_placement
from shared.cpu_placement import Placement, format_cpu_list, parse_cpu_list, plan
from shared.redis_server import RedisServer
from shared.settings import ServiceSettings
from tests.helpers.cpus import ALLOWED, cores_of


@pytest.mark.parametrize(
    ("text", "cpus"),
    [("0", {0}), ("0-2,5", {0, 1, 2, 5}), ("3,1", {1, 3}), ("1-1", {1}), ("", set()), (" 2 , 4-5 ", {2, 4, 5})],
)
def test_cpu_lists_parse_and_print_in_linuxs_form(text: str, cpus: set[int]) -> None:
    assert parse_cpu_list(text) == cpus
    assert parse_cpu_list(format_cpu_list(cpus)) == cpus
    assert format_cpu_list({0, 1, 2, 5, 7, 8}) == "0-2,5,7-8"


@pytest.mark.parametrize("text", ["a", "1-", "3-1", "-1", "0-2;5"])
def test_a_malformed_cpu_list_is_refused_with_the_form_expected(text: str) -> None:
    with pytest.raises(ValueError, match="CPU list"):
        parse_cpu_list(text)
    with pytest.raises(pydantic.ValidationError, match="engine_cpus"):
        ServiceSettings(engine_cpus=text)


def test_the_io_takes_the_lowest_cores_and_the_engine_the_rest() -> None:
    assert plan(frozenset({0, 1}), 1) == Placement(engine_cpus=frozenset({1}), io_cpus=frozenset({0}))
    assert plan(frozenset({2, 5, 7, 9}), 2) == Placement(engine_cpus=frozenset({7, 9}), io_cpus=frozenset({2, 5}))
    assert plan(frozenset({0}), 1) is None  # one core: nothing to bind apart
    assert plan(frozenset({0, 1}), 2) is None  # the engine would have none


def test_settings_choose_the_fleets_placement() -> None:
    assert cpu_placement.for_fleet(ServiceSettings(cpu_bind="off")) is None
    assert cpu_placement.for_fleet(ServiceSettings()) == plan(ALLOWED, 1)
    one = min(ALLOWED)
    chosen = cpu_placement.for_fleet(ServiceSettings(engine_cpus=str(one)))
    assert chosen == Placement(engine_cpus=frozenset({one}), io_cpus=ALLOWED - {one})
    assert cpu_placement.for_worker(ServiceSettings()) is None  # a worker started alone binds nothing
    assert cpu_placement.for_worker(ServiceSettings(engine_cpus=str(one))) == chosen
    outside = max(ALLOWED) + 1
    with pytest.raises(ValueError, match="none of them is allowed"):
        cpu_placement.for_worker(ServiceSettings(engine_cpus=str(outside)))


def test_bound_runs_a_block_on_the_cores_given_and_restores_them() -> None:
    one = frozenset({max(ALLOWED)})
    with cpu_placement.bound(one):
        assert os.sched_getaffinity(0) == one
        seen: list[set[int]] = []
        thread = threading.Thread(target=lambda: seen.append(os.sched_getaffinity(0)))  # a thread started here
        thread.start()
        thread.join()
        assert seen == [one]
    assert os.sched_getaffinity(0) == ALLOWED
    with cpu_placement.bound(None):
        assert os.sched_getaffinity(0) == ALLOWED


def test_redis_starts_on_the_cores_it_is_given(tmp_path: Path) -> None:
    one = frozenset({min(ALLOWED)})
    with RedisServer(tmp_path, appendonly=False, cpus=one) as server:
        assert server.process is not None
        assert cores_of(server.process.pid) == one
        client = redis.Redis.from_url(server.url)
        assert client.ping()
        client.close()
