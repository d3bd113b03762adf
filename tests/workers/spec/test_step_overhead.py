"""StepOverhead: a step's time outside its passes, split into the plain per-sequence share and what a
speculative step adds to it."""

import pytest

from workers.spec.step_overhead import StepOverhead


def test_plain_steps_set_the_baseline_and_speculative_ones_the_excess() -> None:
    overhead = StepOverhead(rate=0.5)
    overhead.observe(rest_s=1.6e-3, num_seqs=16, num_speculating=4)  # no baseline yet: nothing learned
    assert overhead.plain_per_seq_s is None and overhead.speculative_step_s == 0.0
    overhead.observe(rest_s=1.6e-3, num_seqs=16, num_speculating=0)
    assert overhead.plain_per_seq_s == pytest.approx(0.1e-3)
    for _ in range(30):  # 16 sequences: 1.6 ms of plain work + 2 ms for speculating
        overhead.observe(rest_s=3.6e-3, num_seqs=16, num_speculating=4)
    assert overhead.speculative_step_s == pytest.approx(2e-3, rel=1e-3)
    overhead.observe(rest_s=0.4e-3, num_seqs=2, num_speculating=0)  # the baseline scales with the sequences
    assert overhead.plain_per_seq_s == pytest.approx(0.15e-3)


def test_a_fast_speculative_step_never_makes_the_excess_negative() -> None:
    overhead = StepOverhead(rate=1.0)
    overhead.observe(rest_s=2e-3, num_seqs=4, num_speculating=0)
    overhead.observe(rest_s=1e-3, num_seqs=4, num_speculating=2)  # noise: faster than the plain baseline
    assert overhead.speculative_step_s == 0.0


def test_rate_is_checked() -> None:
    with pytest.raises(ValueError):
        StepOverhead(rate=0.0)
