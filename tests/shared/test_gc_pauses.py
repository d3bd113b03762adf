"""shared/gc_pauses.py: a settled process's full collections walk only what came after its start-up (a real
child process that imports the gateway and the engine), and every collection's pause is timed by generation."""

import gc
import json
import subprocess
import sys

import pytest
from prometheus_client import CollectorRegistry

from shared import gc_pauses
from tests.helpers import REPO_ROOT

CHILD = """
import gc, json
import gateway.main, workers.engine.engine  # start-up's objects: modules, routes, validators
from shared import gc_pauses

tracked_before = len(gc.get_objects())  # what a full collection walks (the permanent generation is not walked)
settled = gc_pauses.settle()
cycle = []
cycle.append(cycle)  # garbage made after settling is still collected
del cycle
print(json.dumps({"tracked_before": tracked_before, "tracked_after": len(gc.get_objects()),
                  "frozen": settled.frozen, "freeze_count": gc.get_freeze_count(), "collected_later": gc.collect()}))
"""


def test_a_settled_process_walks_only_what_came_after_start_up() -> None:
    out = subprocess.run([sys.executable, "-c", CHILD], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["tracked_before"] > 50_000  # what a full collection walked before
    assert got["frozen"] == got["freeze_count"] >= got["tracked_before"] * 0.9
    assert got["tracked_after"] < got["tracked_before"] / 20  # what it walks now
    assert got["collected_later"] >= 1  # the cycle made after settling


def test_every_collection_is_timed_by_generation() -> None:
    metrics = gc_pauses.GcMetrics.create(CollectorRegistry())
    observer = gc_pauses.observe(metrics)
    try:
        gc.collect(0)
        gc.collect(2)
        gc.collect(2)
    finally:
        observer.close()
    gc.collect(2)  # after close(): not observed
    counts = {
        sample.labels["generation"]: sample.value
        for family in metrics.pause.collect() for sample in family.samples if sample.name.endswith("_count")
    }
    assert counts["0"] >= 1 and counts["2"] == 2  # gen 0 may also run on its own between the calls
    sums = {
        sample.labels["generation"]: sample.value
        for family in metrics.pause.collect() for sample in family.samples if sample.name.endswith("_sum")
    }
    assert sums["2"] > 0


def test_full_collections_are_spaced_and_shown() -> None:
    before = gc.get_threshold()
    registry = CollectorRegistry()
    metrics = gc_pauses.GcMetrics.create(registry)
    try:
        gc_pauses.space_full_collections(100, metrics)
        assert gc.get_threshold() == (before[0], before[1], 100)  # the younger generations' kept
        shown = {g: registry.get_sample_value("specfleet_gc_threshold", {"generation": g}) for g in "012"}
        assert shown == {"0": before[0], "1": before[1], "2": 100}
    finally:
        gc.set_threshold(*before)
    with pytest.raises(ValueError, match="at least 1"):
        gc_pauses.space_full_collections(0)
