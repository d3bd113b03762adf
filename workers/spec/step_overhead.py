"""What a speculative step costs beyond its forward passes: measured, never configured.

A step's time is its passes' time (the PassCostTables) plus the rest: scheduling, building the passes'
inputs, verification, applying verdicts, the proposers' bookkeeping. The rest of a plain step grows with the
sequences in it; a speculative step adds to it for every sequence that speculates (its proposal, its
verification, its rollback). `StepOverhead` keeps both as exponentially weighted averages of what steps took
on this host, and the length policy charges `per_speculating_seq_s` to each sequence it lets speculate: in a
large batch of cheap passes, where that work eats what drafting saves, the batch stays on plain decoding.
"""

from dataclasses import dataclass


@dataclass
class StepOverhead:
    rate: float = 0.1  # weight of one step's measurement
    plain_per_seq_s: float | None = None  # the rest of a step without speculation, per sequence in it
    per_speculating_seq_s: float = 0.0  # what each speculating sequence adds to a step's rest

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
        extra = max(0.0, rest_s - self.plain_per_seq_s * num_seqs) / num_speculating
        self.per_speculating_seq_s += self.rate * (extra - self.per_speculating_seq_s)
