"""A proposer pass is priced with its share of the proposal's work between forwards (proposal_timing.py)."""

import pytest

from workers.spec.pass_costs import PassCostTable
from workers.spec.proposal_timing import ProposalPasses


def test_held_passes_share_the_time_outside_their_forwards() -> None:
    settled: list[float] = []
    table = PassCostTable(rate=1.0)
    passes = ProposalPasses(settled.append)
    passes.begin()
    passes.observe(table, 1, 0.001)
    passes.observe(table, 1, 0.003)
    assert settled == [] and not table.is_measured  # held until the proposal ends
    passes.end(0.006)  # 2 ms outside the forwards: 1 ms a pass
    assert settled == pytest.approx([0.002, 0.004])
    assert table.estimate_s(1) > 0.002  # the second observation moved the point toward 4 ms
    passes.end(0.5)  # nothing held: nothing settled twice
    assert len(settled) == 2


def test_passes_outside_a_proposal_are_taken_as_timed() -> None:
    settled: list[float] = []
    table = PassCostTable()
    passes = ProposalPasses(settled.append)
    passes.observe(table, 4, 0.002)  # a start-up probe
    assert settled == [0.002] and table.estimate_s(4) == pytest.approx(0.002)


def test_a_proposal_faster_than_its_forwards_adds_nothing() -> None:
    settled: list[float] = []
    passes = ProposalPasses(settled.append)
    passes.begin()
    passes.observe(PassCostTable(), 2, 0.004)
    passes.end(0.003)  # clock granularity: never a negative share
    assert settled == [0.004]
