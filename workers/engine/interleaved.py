"""Two variants of one pass timed against each other on this host, now: the start-up measurements behind
`compile: auto` (compilation.py) and `linear_packing: auto` (packing.py)."""

import statistics
import time
from collections.abc import Callable
from typing import TypeVar

NUM_TIMED_PASSES = 8  # per variant

T = TypeVar("T")


def time_interleaved(run: Callable[[bool], T], num_passes: int = NUM_TIMED_PASSES) -> tuple[float, float, dict[bool, T]]:
    """Median ms of run(False) and of run(True), alternating so load changes hit both alike, and the last
    output of each."""
    times: dict[bool, list[float]] = {False: [], True: []}
    outputs: dict[bool, T] = {}
    for _ in range(num_passes):
        for variant in (False, True):
            start_s = time.perf_counter()
            outputs[variant] = run(variant)
            times[variant].append((time.perf_counter() - start_s) * 1e3)
    return statistics.median(times[False]), statistics.median(times[True]), outputs
