"""Which cores of a host run what: the engine's torch threads on cores of their own, the fleet's I/O (Redis, the
gateway, the Celery worker, the worker's writer process and heartbeat) on the others.

    specfleet up / bench e2e (shared/fleet.py):  for_fleet(settings) -> Placement(engine_cpus, io_cpus)
        Redis, gateway, Celery: started bound to io_cpus;  the worker: SPECFLEET_ENGINE_CPUS=<engine_cpus>
    the worker (shared/cli/fleet.py):            for_worker(settings) -> its main thread (and the torch threads
        it starts) on engine_cpus, its writer process and heartbeat thread on the rest of its allowed cores

Why: with everything on two shared cores, each engine step's hand-off woke the writer, Redis and the gateway,
and the kernel ran them on the engine's core as often as not (a woken task goes where its waker ran): the
engine's step waited behind them. Bound apart, the demo target's fleet TPOT at one client fell from 2.9 ms to
2.05 ms, the in-process engine's 2.1 (main f3209ae, 2026-12-02, a 2-core host; README, "The worker loop").
Anchor: vLLM's CPU backend binds its OpenMP threads to cores and keeps a core for its front-end process.

The I/O takes the lowest-numbered cores (where the kernel's own interrupts and housekeeping usually land), the
engine the rest. With fewer than `reserved_cpus + 1` cores nothing is bound (placement None).
"""

import contextlib
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any


def parse_cpu_list(text: str) -> frozenset[int]:
    """`0-2,5` -> {0, 1, 2, 5} (Linux's cpu-list form, as taskset and cgroups write it); ValueError otherwise."""
    cpus: set[int] = set()
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        first, dash, last = part.partition("-")
        try:
            low, high = int(first), int(last if dash else first)
        except ValueError:
            raise ValueError(f"{text!r} is not a CPU list (e.g. 0-2,5)") from None
        if low < 0 or high < low:
            raise ValueError(f"{text!r} is not a CPU list: the range {part!r} is empty or negative")
        cpus.update(range(low, high + 1))
    return frozenset(cpus)


def format_cpu_list(cpus: Iterable[int]) -> str:
    """{0, 1, 2, 5} -> `0-2,5`."""
    ranges: list[list[int]] = []  # [first, last] of each run of consecutive cores
    for cpu in sorted(set(cpus)):
        if ranges and ranges[-1][1] == cpu - 1:
            ranges[-1][1] = cpu
        else:
            ranges.append([cpu, cpu])
    return ",".join(str(first) if first == last else f"{first}-{last}" for first, last in ranges)


def allowed_cpus() -> frozenset[int]:
    """The cores this process may run on (its affinity: a container's cpuset, a taskset); empty where the OS
    has no affinity call."""
    if not hasattr(os, "sched_getaffinity"):
        return frozenset()
    return frozenset(os.sched_getaffinity(0))


@dataclass(frozen=True)
class Placement:
    engine_cpus: frozenset[int]  # the engine's torch threads (the worker's main thread and its OpenMP pool)
    io_cpus: frozenset[int]  # Redis, gateway, Celery, the worker's writer process and heartbeat thread

    def describe(self) -> str:
        return f"engine on cpus {format_cpu_list(self.engine_cpus)}, I/O on cpus {format_cpu_list(self.io_cpus)}"


def plan(allowed: frozenset[int], reserved_cpus: int) -> Placement | None:
    """The lowest `reserved_cpus` cores for I/O, the rest for the engine; None when that leaves the engine none."""
    ordered = sorted(allowed)
    if reserved_cpus < 1 or len(ordered) <= reserved_cpus:
        return None
    return Placement(engine_cpus=frozenset(ordered[reserved_cpus:]), io_cpus=frozenset(ordered[:reserved_cpus]))


def for_fleet(settings: Any) -> Placement | None:
    """The placement `specfleet up` gives the processes it starts on this host (settings: cpu_bind,
    reserved_cpus, engine_cpus); None: cpu_bind off, or too few cores."""
    if settings.cpu_bind == "off":
        return None
    allowed = allowed_cpus()
    if settings.engine_cpus:  # the operator's choice of engine cores: the I/O gets the others
        return _split(allowed, parse_cpu_list(settings.engine_cpus))
    return plan(allowed, settings.reserved_cpus)


def for_worker(settings: Any) -> Placement | None:
    """The worker's own placement: its engine on settings.engine_cpus (set by `specfleet up`, or by the operator),
    its helpers on its other allowed cores; None when engine_cpus is empty. ValueError when none of the engine
    cores is allowed to this process."""
    if not settings.engine_cpus:
        return None
    return _split(allowed_cpus(), parse_cpu_list(settings.engine_cpus))


def _split(allowed: frozenset[int], engine: frozenset[int]) -> Placement:
    usable = engine & allowed
    if not usable:
        raise ValueError(
            f"engine_cpus {format_cpu_list(engine)}: none of them is allowed to this process "
            f"(allowed: {format_cpu_list(allowed)})"
        )
    return Placement(engine_cpus=usable, io_cpus=allowed - usable)


def bind(cpus: frozenset[int], pid: int = 0) -> None:
    """Run thread `pid` (0: the calling thread) on `cpus` only; threads and processes it starts afterwards inherit
    it. Nothing to do for an empty set or an OS without affinity."""
    if cpus and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(pid, cpus)


@contextlib.contextmanager
def bound(cpus: frozenset[int] | None) -> Iterator[None]:
    """Run the block with the calling thread on `cpus` (when given), then restore its cores."""
    if not cpus or not hasattr(os, "sched_setaffinity"):
        yield
        return
    previous = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, previous)


def binder(cpus: frozenset[int] | None, then: Callable[[], None]) -> Callable[[], None]:
    """A subprocess preexec_fn: bind the child to `cpus` (when given), then call `then`."""
    if not cpus:
        return then

    def preexec() -> None:
        bind(cpus)
        then()

    return preexec
