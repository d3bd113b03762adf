"""StepOverhead: a step's time outside its passes, split into the plain per-sequence share and what each
speculating sequence adds."""

import pytest

from workers.spec.step_overhead import StepOverhead


def test_plain_steps_set_the_baseline_and_speculating_ones_the_extra() -> None:
    overhead = StepOverhead(rate=0.5)
    overhead.observe(rest_s=1.6e-3, num_seqs=16, num_speculating=4)  # no baseline yet: nothing learned
    assert overhead.plain_per_seq_s is None and overhead.per_speculating_seq_s == 0.0
    overhead.observe(rest_s=1.6e-3, num_seqs=16, num_speculating=0)
    assert overhead.plain_per_seq_s == pytest.approx(0.1e-3)
    for _ in range(30):  # 16 sequences, 4 speculating: 1.6 ms of plain work + 4 x 0.5 ms
        overhead.observe(rest_s=3.6e-3, num_seqs=16, num_speculating=4)
    assert overhead.per_speculating_seq_s == pytest.approx(0.5e-3, rel=1e-3)


def test_a_fast_speculative_step_never_makes_the_extra_negative() -> None:
    overhead = StepOverhead(rate=1.0)
    overhead.observe(rest_s=2e-3, num_seqs=4, num_speculating=0)
    overhead.observe(rest_s=1e-3, num_seqs=4, num_speculating=2)  # noise: faster than the plain baseline
    assert overhead.per_speculating_seq_s == 0.0


def test_rate_is_checked() -> None:
    with pytest.raises(ValueError):
        StepOverhead(rate=0.0)
