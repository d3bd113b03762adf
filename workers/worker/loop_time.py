"""Where the worker loop's wall time goes, part by part: the share that is the engine's step is how much of the
engine's speed the fleet gives its clients; the rest is what serving the jobs costs (README "The loop's time,
measured by the worker itself").

    engine    Engine.step
    pull      pulls that held the loop (their round trip to Redis, their jobs' admission into the engine)
    hand_off  the step's writes handed to the writer process
    reports   the writer's reports taken (and, with nothing in the engine, the wait for a final write to land)
    control   cancels and lost jobs (the control channel, the heartbeat's findings), deadlines, the step's cost
              accounting and metrics, the back-off after a Redis failure
    idle      nothing held: blocked on the queues until a job comes (its pull rides that wait)

One clock, charged in turn: each `charge(part)` gives `part` the time since the previous charge, so the parts add
up to the loop's wall time. Exported at scrape time (a prometheus Collector): the loop pays one perf_counter() and
one float addition a part a step, never a metrics call. A wait on the queues (`idling`, up to idle_block_ms) is
counted as it goes: a scrape during it sees the time waited so far, so a benchmark's scrapes around a round charge
it the waits within the round only.
"""

import enum
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector


class LoopPart(enum.StrEnum):
    ENGINE = "engine"
    PULL = "pull"
    HAND_OFF = "hand_off"
    REPORTS = "reports"
    CONTROL = "control"
    IDLE = "idle"


class LoopClock(Collector):
    def __init__(self) -> None:
        self.seconds = dict.fromkeys(LoopPart, 0.0)
        self.num_engine_steps = 0  # Engine.step calls (the tokens they made: specfleet_engine_generated_tokens)
        self._last_s = time.perf_counter()
        self._idle_since_s: float | None = None  # in a wait on the queues since then (perf_counter)
        self._idle_lock = threading.Lock()  # the idle seconds and the wait's start, read together by a scrape

    @contextmanager
    def idling(self) -> Iterator[None]:
        """The loop blocks on the queues: the time is `idle`'s, counted as it goes."""
        with self._idle_lock:
            self._idle_since_s = self._last_s = time.perf_counter()
        try:
            yield
        finally:
            with self._idle_lock:
                now_s = time.perf_counter()
                self.seconds[LoopPart.IDLE] += now_s - (self._idle_since_s or now_s)
                self._idle_since_s = None
                self._last_s = now_s

    def restart(self) -> None:
        """Charge nothing for the time since the last charge (the loop starts, or comes back from elsewhere)."""
        self._last_s = time.perf_counter()

    @property
    def last_charge_s(self) -> float:
        """When the last charge (or restart) was made (perf_counter): a step's clock reading at no cost."""
        return self._last_s

    def charge(self, part: LoopPart) -> float:
        """-> the seconds charged to `part` now."""
        now_s = time.perf_counter()
        seconds = now_s - self._last_s
        self.seconds[part] += seconds
        self._last_s = now_s
        return seconds

    def collect(self) -> Iterable[CounterMetricFamily]:
        seconds = CounterMetricFamily(
            "specfleet_worker_loop_seconds", "The worker loop's wall time by part (workers/worker/loop_time.py)",
            labels=["part"],
        )
        with self._idle_lock:
            values = dict(self.seconds)
            if self._idle_since_s is not None:
                values[LoopPart.IDLE] += time.perf_counter() - self._idle_since_s
        for part, value in values.items():
            seconds.add_metric([part.value], value)
        yield seconds
        yield CounterMetricFamily(
            "specfleet_worker_engine_steps", "Engine steps the worker loop ran", value=self.num_engine_steps
        )
