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
- `space_full_collections()`: full collections at most every N collections of the middle generation (CPython's
  default: 10), for a process whose heap grows by many short-lived objects at once: the gateway, whose every
  open SSE stream keeps ~100 objects alive for as long as its job runs, so each full collection during a burst
  of 2,000 stream opens walked them all (up to 250 ms a walk at 0395934). At 6a8209a (`bench e2e --quick
  --model demo`, three alternated pairs and one more for memory, 2026-12-05), every 100 took the gateway's
  collections over the benchmark's phases from 0.73-0.88 s to 0.24-0.36 s and the longest from the 100-250 ms
  bucket to 10-50 ms, and its CPU over the 2,000-stream phase from 2.84-2.90 to 2.45-2.65 s, at the same peak
  memory (139.2 against 138.8 MB resident). Garbage in cycles that outlives the two younger generations waits
  longer for its collection; CPython still holds a full collection back until the objects added to the oldest
  generation since the last one pass a quarter of those it kept then.
- `observe()`: every collection's pause, by generation, into `specfleet_gc_pause_seconds` (a gc callback, ~2 us
  a collection), with `specfleet_gc_frozen_objects` and `specfleet_gc_threshold{generation}` beside it.
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
    threshold: Gauge  # gc.get_threshold(), label `generation`, as settle() / space_full_collections() left it

    @classmethod
    def create(cls, registry: CollectorRegistry | None) -> "GcMetrics":
        """In `registry` (a process's own; the default registry's are `process_metrics()`)."""
        pause = Histogram("specfleet_gc_pause_seconds", "Pauses of Python's cyclic garbage collector, by generation",
                          ["generation"], buckets=PAUSE_BUCKETS_S, registry=registry)
        frozen = Gauge("specfleet_gc_frozen_objects", "Objects start-up left that no collection walks (gc.freeze)",
                       registry=registry, multiprocess_mode="max")
        threshold = Gauge("specfleet_gc_threshold", "The collector's thresholds, by generation (gc.set_threshold)",
                          ["generation"], registry=registry, multiprocess_mode="max")
        return cls(pause, frozen, threshold)

    def show_thresholds(self) -> None:
        for generation, value in enumerate(gc.get_threshold()):
            self.threshold.labels(str(generation)).set(value)


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
        metrics.show_thresholds()
    log.info("gc: %d start-up objects frozen in %.0f ms (%d collected first)", done.frozen, done.seconds * 1e3,
             done.collected)
    return done


def space_full_collections(every: int, metrics: GcMetrics | None = None) -> None:
    """Full collections at most every `every` collections of the middle generation; the younger thresholds kept."""
    if every < 1:
        raise ValueError(f"every must be at least 1, got {every}")
    young, middle, _ = gc.get_threshold()
    gc.set_threshold(young, middle, every)
    if metrics is not None:
        metrics.show_thresholds()
    log.info("gc: full collections at most every %d middle-generation collections", every)


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
