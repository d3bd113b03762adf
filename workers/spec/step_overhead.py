"""What speculating adds to a step beyond its forward passes: measured, never configured.

A step's time is its passes' time (the PassCostTables) plus the rest: scheduling, building the passes'
inputs, verification, applying verdicts. (A proposer's work between its forwards - drawing tokens, building
the next pass - is priced into its passes instead: proposal_timing.py.) The rest of a plain step grows with the
sequences in it; a step in which some sequences speculate costs more (proposals, verification, rollback).
`StepOverhead` keeps both as exponentially weighted averages of what steps took on this host: the plain rest
per sequence, and what a speculative step's rest exceeds that by. The length policy charges the excess to a
step it lets speculate: in a large batch of cheap passes, where that work eats what drafting saves, the
batch stays on plain decoding.

The excess is charged per step, not per speculating sequence: most of it is per step (one verification
call, one proposal round), and a per-sequence charge measured at batch 1 would forbid speculating at batch 4
before it could ever be measured there.
"""

from dataclasses import dataclass


@dataclass
class StepOverhead:
    rate: float = 0.1  # weight of one step's measurement
    plain_per_seq_s: float | None = None  # the rest of a step without speculation, per sequence in it
    speculative_step_s: float = 0.0  # what a step with speculating sequences adds to that rest

    def __post_init__(self) -> None:
        if not 0.0 < self.rate <= 1.0:
            raise ValueError(f"rate must be in (0, 1], got {self.rate}")

    def observe(self, rest_s: float, num_seqs: int, num_speculating: int) -> None:
        """One step: `rest_s` seconds outside its passes, `num_seqs` sequences stepped, `num_speculating` of
        them verifying draft tokens."""
        if num_seqs <= 0 or rest_s < 0.0:
            return
        if num_speculating == 0:
            per_seq = rest_s / num_seqs
            old = self.plain_per_seq_s
            self.plain_per_seq_s = per_seq if old is None else old + self.rate * (per_seq - old)
            return
        if self.plain_per_seq_s is None:  # no plain baseline yet to tell the speculation's share
            return
        extra = max(0.0, rest_s - self.plain_per_seq_s * num_seqs)
        self.speculative_step_s += self.rate * (extra - self.speculative_step_s)
