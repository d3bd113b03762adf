"""A proposer pass is priced with its share of the proposal's work between forwards (proposal_timing.py)."""

import pytest

from workers.spec.pass_costs import PassCostTable, PassTiming
from workers.spec.proposal_timing import ProposalPasses


def seconds_of(settled: list[PassTiming]) -> list[float]:
    return [timing.seconds for timing in settled]


def test_held_passes_share_the_time_outside_their_forwards() -> None:
    settled: list[PassTiming] = []
    table = PassCostTable(rate=1.0)
    passes = ProposalPasses(settled.append)
    passes.begin()
    passes.observe(table, PassTiming(1, 0.001))
    passes.observe(table, PassTiming(1, 0.003))
    assert settled == [] and not table.is_measured  # held until the proposal ends
    passes.end(0.006)  # 2 ms outside the forwards: 1 ms a pass
    assert seconds_of(settled) == pytest.approx([0.002, 0.004])
    assert table.estimate_s(1) > 0.002  # the second observation moved the point toward 4 ms
    passes.end(0.5)  # nothing held: nothing settled twice
    assert len(settled) == 2


def test_passes_outside_a_proposal_are_taken_as_timed() -> None:
    settled: list[PassTiming] = []
    table = PassCostTable()
    passes = ProposalPasses(settled.append)
    passes.observe(table, PassTiming(4, 0.002))  # a start-up probe
    assert seconds_of(settled) == [0.002] and table.estimate_s(4) == pytest.approx(0.002)


def test_a_proposal_faster_than_its_forwards_adds_nothing() -> None:
    settled: list[PassTiming] = []
    passes = ProposalPasses(settled.append)
    passes.begin()
    passes.observe(PassCostTable(), PassTiming(2, 0.004))
    passes.end(0.003)  # clock granularity: never a negative share
    assert seconds_of(settled) == [0.004]


def test_a_pass_of_a_new_shape_is_settled_but_not_taken_as_what_the_shape_costs() -> None:
    """Its runner's first pass of a shape carries one-time set-up (PassTiming.is_first_of_shape): the step still
    counts its seconds, the table does not learn from them."""
    settled: list[PassTiming] = []
    table = PassCostTable()
    passes = ProposalPasses(settled.append)
    passes.begin()
    passes.observe(table, PassTiming(8, 0.009, is_first_of_shape=True))
    passes.observe(table, PassTiming(4, 0.001))
    passes.end(0.010)
    assert seconds_of(settled) == pytest.approx([0.009, 0.001])
    assert [t.is_first_of_shape for t in settled] == [True, False]
    assert table.snapshot() == {4: pytest.approx(1.0)}  # only the shape run before
