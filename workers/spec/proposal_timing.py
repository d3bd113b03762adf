"""What a proposer's pass costs in a step: its forward, and its share of the work between forwards.

A chain of k draft tokens is k proposer passes, and around each forward the proposer draws the next token
(argmax or a sampled draw over the vocabulary, the grammar's mask), keeps the rows still drafting and builds
the next pass's inputs: about 0.2 ms a pass at batch 1 on the demo pair and 0.35 ms at 16 sequences, beside
forwards of 0.6-1.5 ms. Timed as part of the step's rest (step_overhead.py), that work would be charged once a
step whatever the length chosen, so the length policy would take long chains and many drafting sequences for
cheaper than they are. `ProposalPasses` holds the passes of one proposal back, then hands each to its cost
table with an equal share of the proposal's time outside its forwards: the tables then price a pass as the
proposer runs it, and a longer chain pays for every pass it adds.
"""

from collections.abc import Callable
from dataclasses import replace

from workers.spec.pass_costs import PassCostTable, PassTiming


class ProposalPasses:
    def __init__(self, on_settled: Callable[[PassTiming], None]) -> None:
        self.on_settled = on_settled  # called with each settled pass (the step's time in passes)
        self._held: list[tuple[PassCostTable, PassTiming]] | None = None

    def begin(self) -> None:
        """A proposal starts: its passes are held until end()."""
        self._held = []

    def observe(self, table: PassCostTable, timing: PassTiming) -> None:
        """One proposer forward; outside a proposal (start-up probes) it is settled at once."""
        if self._held is None:
            self._settle(table, timing)
            return
        self._held.append((table, timing))

    def end(self, elapsed_s: float) -> None:
        """The proposal took elapsed_s in all: each held pass gets an equal share of what its forwards did not."""
        held, self._held = self._held or [], None
        if not held:
            return
        share_s = max(0.0, elapsed_s - sum(timing.seconds for _, timing in held)) / len(held)
        for table, timing in held:
            self._settle(table, replace(timing, seconds=timing.seconds + share_s))

    def _settle(self, table: PassCostTable, timing: PassTiming) -> None:
        """A pass of a shape run before goes to its table; a first one's set-up is not what the shape costs."""
        if not timing.is_first_of_shape:
            table.observe(timing.num_tokens, timing.seconds, timing.work)
        self.on_settled(timing)
