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


def test_the_excess_splits_into_a_part_per_step_and_one_per_speculating_sequence() -> None:
    overhead = StepOverhead(rate=0.2)
    overhead.observe(rest_s=1.6e-3, num_seqs=16, num_speculating=0)  # plain: 0.1 ms a sequence
    for _ in range(200):  # 0.5 ms a step + 0.1 ms a speculating sequence, at 1 and at 16 of them
        for n in (1, 16):
            overhead.observe(rest_s=1.6e-3 + 0.5e-3 + 0.1e-3 * n, num_seqs=16, num_speculating=n)
    assert overhead.speculative_step_s == pytest.approx(0.5e-3, rel=1e-3)
    assert overhead.speculative_seq_s == pytest.approx(0.1e-3, rel=1e-3)
    assert overhead.speculative_step_s + 16 * overhead.speculative_seq_s == pytest.approx(2.1e-3, rel=1e-3)


def test_one_count_of_speculating_sequences_keeps_the_excess_per_step() -> None:
    overhead = StepOverhead(rate=0.5)
    overhead.observe(rest_s=0.2e-3, num_seqs=1, num_speculating=0)
    for _ in range(20):  # batch 1 only: no way to tell a per-sequence part
        overhead.observe(rest_s=1.2e-3, num_seqs=1, num_speculating=1)
    assert overhead.speculative_seq_s == 0.0 and overhead.speculative_step_s == pytest.approx(1e-3)
