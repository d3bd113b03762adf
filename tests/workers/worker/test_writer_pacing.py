"""The writer's pacing: while steps come one after another it sleeps until the next is due and then looks every
poll interval; a step that leaves the engine empty, or a long gap, sends it back to blocking on the pipe; `auto`
paces where the start's probes measured a wake-up costing the loop's send more than WAKE_COST_MIN_US."""

import time

import pytest
import redis

from shared.settings import ServiceSettings
from tests.helpers.redis_fixtures import job_record
from tests.workers.worker.test_writer import _take, _tokens
from workers.worker.emitter import JobWrite
from workers.worker.writer import StepWrite, StepWriter
from workers.worker.writer_pacing import (
    IDLE_AFTER_STEPS,
    MAX_POLL_S,
    MIN_POLL_S,
    POLLS_PER_STEP,
    PROBE_WAIT_S,
    WAKE_COST_MIN_US,
    Pacer,
    choose,
)

STEP_S = 2e-3


def _pacing(steps: int, step_s: float = STEP_S) -> tuple[Pacer, float]:
    """A pacer that read `steps` steps `step_s` apart, none leaving the engine empty; (it, the last read's time)."""
    pacer = Pacer(is_on=True)
    now_s = 10.0
    for _ in range(steps):
        now_s += step_s
        pacer.read(now_s, 1, engine_idle=False)
    return pacer, now_s


def test_it_sleeps_until_the_step_is_due_then_looks_each_poll_interval() -> None:
    pacer, last_s = _pacing(20)
    assert pacer.is_pacing and pacer.step_interval_s == pytest.approx(STEP_S)
    poll_s = STEP_S / POLLS_PER_STEP
    assert pacer.wait_s(last_s + 0.3e-3) == pytest.approx(STEP_S - 0.3e-3 - poll_s / 2)  # just before it is due
    assert pacer.wait_s(last_s + STEP_S) == pytest.approx(poll_s)  # due: a look each poll interval


def test_the_poll_interval_keeps_within_its_bounds() -> None:
    fast, fast_last_s = _pacing(20, step_s=0.1e-3)
    slow, slow_last_s = _pacing(20, step_s=50e-3)
    assert fast.wait_s(fast_last_s + 0.1e-3) == pytest.approx(MIN_POLL_S)
    assert slow.wait_s(slow_last_s + 50e-3) == pytest.approx(MAX_POLL_S)


def test_a_step_that_leaves_the_engine_empty_or_a_long_gap_blocks_again() -> None:
    pacer, last_s = _pacing(5)
    pacer.read(last_s + STEP_S, 1, engine_idle=True)
    assert not pacer.is_pacing and pacer.wait_s(last_s + STEP_S) is None
    pacer, last_s = _pacing(5)
    assert pacer.wait_s(last_s + (IDLE_AFTER_STEPS + 1) * STEP_S) is None and not pacer.is_pacing


def test_the_gap_before_pacing_is_not_a_step_interval() -> None:
    """The first step after blocking came after an idle wait: its gap does not count; steps read together do
    (each the gap over their number)."""
    pacer = Pacer(is_on=True)
    pacer.read(1.0, 1, engine_idle=False)  # after a long idle wait
    assert pacer.step_interval_s is None
    pacer.read(1.0 + 4 * STEP_S, 4, engine_idle=False)
    assert pacer.step_interval_s == pytest.approx(STEP_S)


def test_a_pacer_turned_off_never_paces() -> None:
    pacer = Pacer(is_on=False)
    pacer.read(1.0, 1, engine_idle=False)
    assert not pacer.is_pacing and pacer.wait_s(1.0001) is None


@pytest.mark.parametrize(("wake_us", "plain_us", "is_on"), [(45.0, 8.0, True), (6.0, 4.0, False)])
def test_auto_paces_where_a_wake_up_costs_the_send_more(wake_us: float, plain_us: float, is_on: bool) -> None:
    """The sends timed `PROBE_WAIT_S` after an answer found the writer blocked; those timed half that after,
    asleep (the sends' costs here stand for a host's)."""
    def send_us(probe_sleep_s: float, wait_s: float) -> float:
        return wake_us if wait_s == PROBE_WAIT_S else plain_us

    choice = choose("auto", send_us)
    assert (choice.is_on, choice.wake_send_us, choice.plain_send_us) == (is_on, wake_us, plain_us)
    assert (wake_us - plain_us >= WAKE_COST_MIN_US) == is_on
    assert f"{wake_us:.1f} us" in choice.describe()


def test_on_and_off_take_no_measure() -> None:
    def send_us(probe_sleep_s: float, wait_s: float) -> float:
        raise AssertionError("no probe")

    assert choose("on", send_us).is_on and not choose("off", send_us).is_on


def test_the_writer_process_measures_its_wake_up_at_start(rclient: redis.Redis, settings: ServiceSettings) -> None:
    writer = StepWriter(settings.model_copy(update={"writer_pacing": "auto"}))
    writer.start()
    writer.stop()
    assert writer.pacing is not None and writer.pacing.setting == "auto"
    assert writer.pacing.wake_send_us is not None and writer.pacing.wake_send_us > 0
    assert writer.pacing.plain_send_us is not None and writer.pacing.plain_send_us > 0


def test_a_pacing_writer_lands_every_step_in_order(rclient: redis.Redis, settings: ServiceSettings) -> None:
    """Steps a step interval apart and then the last one, which leaves the engine empty: all land, in order."""
    running = _take(rclient, settings, 2)
    writer = StepWriter(settings.model_copy(update={"writer_pacing": "on"}))
    writer.start()
    try:
        assert writer.pacing is not None and writer.pacing.is_on
        num_steps = 30
        reports = []
        for step in range(num_steps):
            is_last = step == num_steps - 1
            writes = [_tokens(job, step, is_last) for job in running.values()]
            writer.submit(StepWrite(0, writes, engine_idle=is_last))
            reports += writer.take_reports(STEP_S)  # the loop's step time
        reports += writer.drain(30)
    finally:
        writer.stop()
    assert sorted(j for r in reports for j in r.ended) == sorted(running)
    for job_id in running:
        assert job_record(rclient, job_id)["token_ids"] == ",".join(map(str, range(num_steps)))


def test_a_step_that_ends_a_job_rings_the_pacing_writer_awake(rclient: redis.Redis, settings: ServiceSettings) -> None:
    """Steps 0.4 s apart: the pacing writer sleeps until the next is due. A job's last step handed over soon after
    one rings its doorbell (StepWrite.is_urgent) and is written then, long before the step interval would have woken it."""
    interval_s = 0.4
    running = _take(rclient, settings, 1)
    (job,) = running.values()
    writer = StepWriter(settings.model_copy(update={"writer_pacing": "on"}))
    writer.start()
    try:
        for step in range(3):
            writer.submit(StepWrite(0, [_tokens(job, step)]))
            time.sleep(interval_s)
        writer.take_reports()
        writer.submit(StepWrite(0, [_tokens(job, 3)]))  # the writer's next look is due interval_s after this
        time.sleep(0.01)
        handed_s = time.monotonic()
        last = StepWrite(0, [_tokens(job, 4, is_finished=True)], engine_idle=True)
        assert last.is_urgent
        writer.submit(last)
        ended: list[str] = []
        while not ended and time.monotonic() - handed_s < 5:
            ended += [job_id for report in writer.take_reports(0.05) for job_id in report.ended]
        answered_s = time.monotonic() - handed_s
    finally:
        writer.stop()
    assert ended == [job.job_id] and answered_s < interval_s / 2
    assert job_record(rclient, job.job_id)["token_ids"] == "0,1,2,3,4"


def test_a_job_s_first_tokens_and_its_end_are_urgent_its_middle_is_not() -> None:
    first = JobWrite("job-1", 1, 3, 1, new_text="a", new_token_ids=(7,))
    middle = JobWrite("job-1", 1, 3, 2, new_text="b", new_token_ids=(8,))
    last = JobWrite("job-1", 1, 3, 3, new_text="c", new_token_ids=(9,), finish_reason="length", is_finished=True)
    assert StepWrite(0, [middle, first]).is_urgent and StepWrite(0, [last]).is_urgent
    assert not StepWrite(0, [middle]).is_urgent and StepWrite(0, [middle], engine_idle=True).is_urgent
