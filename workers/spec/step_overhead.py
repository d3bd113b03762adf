"""What speculating adds to a step beyond its forward passes: measured, never configured.

A step's time is its passes' time (the PassCostTables) plus the rest: scheduling, building the passes'
inputs, verification, applying verdicts. (A proposer's work between its forwards - drawing tokens, building
the next pass - is priced into its passes instead: proposal_timing.py.) The rest of a plain step grows with the
sequences in it; a step in which some sequences speculate costs more (proposals, verification, rollback).
`StepOverhead` keeps both as exponentially weighted averages of what steps took on this host: the plain rest
per sequence, and what a speculative step's rest exceeds that by. The length policy charges the excess to a
step it lets speculate: in a large batch of cheap passes, where that work eats what drafting saves, the
batch stays on plain decoding.

The excess has a part per step (one verification call, one proposal round) and a part per speculating
sequence (its rows to verify, its verdict to apply): at 16 sequences it is twice what it is at 1. Both are
fitted together, as a line through exponentially weighted moments of (speculating sequences, excess); while
every speculative step had the same number of speculating sequences the line cannot be told from its mean,
and the whole excess stays per step - so a per-sequence charge measured at batch 1 never forbids speculating
at batch 4 before it could be measured there.
"""

from dataclasses import dataclass

MIN_SPREAD = 0.25  # variance of the speculating-sequence count below which the excess stays one per-step figure


@dataclass
class StepOverhead:
    rate: float = 0.1  # weight of one step's measurement
    plain_per_seq_s: float | None = None  # the rest of a step without speculation, per sequence in it
    speculative_step_s: float = 0.0  # what a step with speculating sequences adds to that rest: per step
    speculative_seq_s: float = 0.0  # ... and per speculating sequence
    _moments: tuple[float, float, float, float] | None = None  # EWMA of n, excess, n^2, n * excess

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
        n = float(num_speculating)
        sample = (n, extra, n * n, n * extra)
        old_moments = self._moments or sample
        mean_n, mean_extra, mean_nn, mean_n_extra = (m + self.rate * (x - m) for m, x in zip(old_moments, sample, strict=True))
        self._moments = (mean_n, mean_extra, mean_nn, mean_n_extra)
        spread = mean_nn - mean_n * mean_n
        slope = max(0.0, (mean_n_extra - mean_n * mean_extra) / spread) if spread > MIN_SPREAD else 0.0
        self.speculative_seq_s = slope
        self.speculative_step_s = max(0.0, mean_extra - slope * mean_n)
