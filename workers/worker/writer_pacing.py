"""How the writer process waits for the loop's next step: blocked on the pipe, or paced (asleep, then a look).

    loop (engine core):  engine.step() -> send(step) -> the next step
    writer (I/O core):   blocked on the pipe -> the send wakes it: the loop's send pays for the wake-up
                         paced: asleep until the step is due, then a non-blocking read every poll interval:
                                the loop's send finds nobody waiting, and costs it what a plain write does

A send that wakes a process blocked on the other core costs the sender that core's wake-up. On some hosts that
is a few microseconds; on a virtual machine whose idle vCPUs halt it was 37 us of the loop's own time a step,
and the engine's next step ran ~40 us slower after it (demo pair, one sequence, 1.8 ms steps, 2026-12-06):
~4 % of every decode step. Pacing moves the wait to the writer's own timer, on the I/O core. The writer paces
only while steps come one after another: a step that leaves the engine empty (`StepWrite.engine_idle`), or no
step for `IDLE_AFTER_STEPS` step intervals, sends it back to blocking, so the first step of the next job wakes
it at once (its first token is written without a poll's delay) and an idle fleet's writer sleeps for good. It
sleeps on a doorbell (a second socket pair), not on the pipe: the loop rings it after a step that must not wait
for the next look (`StepWrite.is_urgent`: a job's end, a job's first tokens), so pacing delays only the middle of a job.

The step interval is measured here (an average of the gaps between steps read while pacing); the poll interval
is a fraction of it, so a slow step (a GPU's large model, a full batch) is looked for about as often per step as
a fast one. Whether to pace at all is measured at start (writer.py: `StepWriter.start`, setting `writer_pacing`).
"""

import statistics
from collections.abc import Callable
from dataclasses import dataclass

POLLS_PER_STEP = 8  # poll interval = the step interval / this (within the two bounds below)
MIN_POLL_S = 50e-6
MAX_POLL_S = 1e-3
IDLE_AFTER_STEPS = 4  # no step for this many step intervals: block on the pipe again
MIN_IDLE_AFTER_S = 2e-3
AVERAGE_WEIGHT = 0.2  # of the newest gap in the step interval's moving average


class Pacer:
    def __init__(self, is_on: bool) -> None:
        self.is_on = is_on
        self.step_interval_s: float | None = None  # moving average of the gaps between steps read while pacing
        self._last_step_s = 0.0  # when the last step was read (monotonic)
        self._is_pacing = False

    @property
    def is_pacing(self) -> bool:
        return self._is_pacing

    def read(self, now_s: float, num_steps: int, engine_idle: bool) -> None:
        """`num_steps` steps were read at `now_s`; the last of them left the engine empty or not."""
        if self._is_pacing and num_steps > 0:
            gap_s = (now_s - self._last_step_s) / num_steps
            held = self.step_interval_s
            self.step_interval_s = gap_s if held is None else held + AVERAGE_WEIGHT * (gap_s - held)
        self._last_step_s = now_s
        self._is_pacing = self.is_on and not engine_idle

    def wait_s(self, now_s: float) -> float | None:
        """How long to sleep before the next look at the pipe; None: block on it (nothing is due soon)."""
        if not self._is_pacing:
            return None
        interval_s = self.step_interval_s if self.step_interval_s is not None else MIN_IDLE_AFTER_S / IDLE_AFTER_STEPS
        since_s = now_s - self._last_step_s
        if since_s > max(MIN_IDLE_AFTER_S, IDLE_AFTER_STEPS * interval_s):
            self._is_pacing = False
            return None
        poll_s = min(MAX_POLL_S, max(MIN_POLL_S, interval_s / POLLS_PER_STEP))
        return max(poll_s, interval_s - since_s - poll_s / 2)  # until just before the step is due, then each poll


# -- whether to pace: measured at start -------------------------------------------------------------------------
NUM_PROBES = 15  # of each kind
PROBE_WAIT_S = 2e-3  # after the last answer: the writer is blocked by then (or asleep, for a plain probe)
WAKE_COST_MIN_US = 10.0  # pace where a wake-up costs the loop's send at least this much more than a plain send


@dataclass(frozen=True)
class PacingChoice:
    is_on: bool
    setting: str  # auto | on | off
    wake_send_us: float | None = None  # median send to a writer blocked on the pipe (auto only)
    plain_send_us: float | None = None  # median send to a writer asleep away from it

    def describe(self) -> str:
        state = "paces its waits for steps" if self.is_on else "blocks on the pipe between steps"
        if self.wake_send_us is None or self.plain_send_us is None:
            return f"{state} (writer_pacing {self.setting})"
        return (f"{state} (writer_pacing auto: a send that wakes it costs the loop {self.wake_send_us:.1f} us, "
                f"one that does not {self.plain_send_us:.1f} us)")


def choose(setting: str, send_us: Callable[[float, float], float]) -> PacingChoice:
    """`setting` on/off as it says; auto measures: `send_us(probe_sleep_s, wait_s)` times one send to the writer
    process (StepWriter._send_us), which answers and then sleeps `probe_sleep_s` away from the pipe. Sends to it
    blocked (sleep 0) and to it asleep alternate, NUM_PROBES of each."""
    if setting != "auto":
        return PacingChoice(setting == "on", setting)
    wake_us: list[float] = []
    plain_us: list[float] = []
    send_us(2 * PROBE_WAIT_S, 0.0)  # the next send finds the writer asleep
    for _ in range(NUM_PROBES):
        plain_us.append(send_us(0.0, PROBE_WAIT_S / 2))  # within the last probe's sleep: it is not on the pipe
        wake_us.append(send_us(2 * PROBE_WAIT_S, PROBE_WAIT_S))  # it blocked on the pipe right after the last
    wake, plain = statistics.median(wake_us), statistics.median(plain_us)
    return PacingChoice(wake - plain >= WAKE_COST_MIN_US, setting, wake, plain)
