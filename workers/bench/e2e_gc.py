"""`bench e2e`: the garbage collector's pauses in the fleet's worker and gateway while the benchmark loads them.

Each process exports `specfleet_gc_pause_seconds{generation}` (shared/gc_pauses.py). A scrape before a phase and
one after give the collections the phase caused: how many, their seconds in all, and the longest one's bound (the
histogram's smallest bucket that holds every pause of the phase).
"""

import math
from dataclasses import dataclass, field

from workers.bench.http_client import metric_samples

PAUSE = "specfleet_gc_pause_seconds"


@dataclass
class GcSnapshot:
    count: float = 0.0  # collections, every generation
    seconds: float = 0.0  # their pauses in all
    buckets: dict[float, float] = field(default_factory=dict)  # le -> collections that took at most le seconds


def scrape(url: str, headers: tuple[tuple[str, str], ...] = ()) -> GcSnapshot:
    """The process's pause histogram, its generations added (an empty snapshot if it exports none)."""
    snapshot = GcSnapshot()
    for sample in metric_samples(url, headers):
        if sample.name == f"{PAUSE}_count":
            snapshot.count += sample.value
        elif sample.name == f"{PAUSE}_sum":
            snapshot.seconds += sample.value
        elif sample.name == f"{PAUSE}_bucket":
            le = float(sample.labels["le"])
            snapshot.buckets[le] = snapshot.buckets.get(le, 0.0) + sample.value
    return snapshot


def during(before: GcSnapshot, after: GcSnapshot, process: str) -> dict[str, float]:
    """The phase's collections in `process`: fleet_gc_{pauses,pause_s,pause_max_ms_le}_<process>."""
    num = after.count - before.count
    longest_le = next(
        (le for le in sorted(after.buckets) if after.buckets[le] - before.buckets.get(le, 0.0) >= num), math.inf
    )
    return {
        f"fleet_gc_pauses_{process}": num,
        f"fleet_gc_pause_s_{process}": after.seconds - before.seconds,
        f"fleet_gc_pause_max_ms_le_{process}": longest_le * 1e3 if num else 0.0,
    }
