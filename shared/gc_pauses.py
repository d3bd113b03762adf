"""Python's cyclic garbage collector in the fleet's long-running processes: start-up frozen, every pause measured.

A full collection walks every object the collector tracks. After start-up that is mostly what start-up made and
keeps for the process's life (modules, FastAPI's routes and pydantic's validators, the engine's modules and
tokenizer): ~440,000 objects in a demo worker, ~200 ms a walk on this machine kind. At d155941 nothing kept
them out of it: in `bench e2e --quick --model demo` (2026-12-04) each worker paused 220-230 ms once during its
load, and every job's next step waited behind it. (The gateway's pauses while it opens 2,000 SSE streams at
once, 120-330 ms each, walk the streams' own objects, which no freeze covers: README, "The worker loop".)

- `settle()`, once a process has started (the worker after its warm-up, the gateway once its app serves, the
  tasks process once Celery is ready, the writer process): one collection, then `gc.freeze()`. What is alive
  then moves to the permanent generation, which no collection walks; later objects are collected as before, and
  a full collection walks only them. The objects frozen are never freed by the collector, so a process settles
  once, after the start-up garbage is collected (vLLM's workers freeze their heap after warm-up; SGLang too).
- `observe()`: every collection's pause, by generation, into `specfleet_gc_pause_seconds` (a gc callback, ~2 us
  a collection), with `specfleet_gc_frozen_objects` beside it.
"""

import functools
import gc
import logging
import time
from dataclasses import dataclass
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry, Gauge, Histogram

log = logging.getLogger(__name__)

PAUSE_BUCKETS_S = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


@dataclass(frozen=True)
class FrozenHeap:
    collected: int  # unreachable objects the last collection before the freeze found
    frozen: int  # objects in the permanent generation after it
    seconds: float  # the collection and the freeze


@dataclass(frozen=True)
class GcMetrics:
    pause: Histogram  # seconds a collection took, label `generation` ("0", "1", "2")
    frozen: Gauge  # objects in the permanent generation

    @classmethod
    def create(cls, registry: CollectorRegistry | None) -> "GcMetrics":
        """In `registry` (a process's own; the default registry's are `process_metrics()`)."""
        pause = Histogram("specfleet_gc_pause_seconds", "Pauses of Python's cyclic garbage collector, by generation",
                          ["generation"], buckets=PAUSE_BUCKETS_S, registry=registry)
        frozen = Gauge("specfleet_gc_frozen_objects", "Objects start-up left that no collection walks (gc.freeze)",
                       registry=registry, multiprocess_mode="max")
        return cls(pause, frozen)


@functools.cache
def process_metrics() -> GcMetrics:
    """This process's, in the default registry (the gateway's and the Celery worker's /metrics, and the gateway's
    multiprocess directory): made once, whichever modules ask."""
    return GcMetrics.create(REGISTRY)


def settle(metrics: GcMetrics | None = None) -> FrozenHeap:
    """Collect once, then freeze what is alive: call once, when the process has started and before it serves."""
    start_s = time.perf_counter()
    collected = gc.collect()
    gc.freeze()
    done = FrozenHeap(collected, gc.get_freeze_count(), time.perf_counter() - start_s)
    if metrics is not None:
        metrics.frozen.set(done.frozen)
    log.info("gc: %d start-up objects frozen in %.0f ms (%d collected first)", done.frozen, done.seconds * 1e3,
             done.collected)
    return done


class PauseObserver:
    """A gc callback timing each collection into `metrics.pause`. `close()` removes it (tests)."""

    def __init__(self, metrics: GcMetrics) -> None:
        self._children = [metrics.pause.labels(str(generation)) for generation in range(3)]  # gen 0, 1, 2
        self._start_s = 0.0
        gc.callbacks.append(self._on_collection)

    def _on_collection(self, phase: str, info: dict[str, Any]) -> None:
        # collections do not nest, and a callback runs in the collecting thread with the GIL held
        if phase == "start":
            self._start_s = time.perf_counter()
        else:
            self._children[info["generation"]].observe(time.perf_counter() - self._start_s)

    def close(self) -> None:
        if self._on_collection in gc.callbacks:
            gc.callbacks.remove(self._on_collection)


def observe(metrics: GcMetrics) -> PauseObserver:
    """Time every collection of this process from now on."""
    return PauseObserver(metrics)
