"""How far the length policy's predicted step times are from the steps' measured times, by batch size.

The policy predicts a step's time from its parts (pass cost tables, proposer passes, the measured rest).
Where the parts miss something - a token tree's verification at 16 sequences, a catch-up pass over a long
backlog mixed with a prefill - a speculative step runs longer than predicted, while a plain step, whose
parts are fewer and measured every step, is predicted well; the policy then speculates where it loses.
`StepCalibration` keeps, per batch size bucket (the decoding sequences' count, by powers of two), an
exponentially weighted average of measured / predicted time for speculative steps and for plain steps, and
the policy scales a speculative plan's predicted time by their ratio. Only costs are scaled, never the
acceptance estimates, so a sequence is never kept from drafting by its own misses; and a bucket that stops
speculating keeps its factor until steps that speculate there measure it again.
"""

from dataclasses import dataclass, field

RATIO_BOUNDS = (0.25, 4.0)  # one step's measured / predicted is clipped here: a stall is not a miscalibration


def bucket_of(num_decodes: int) -> int:
    """1 | 2-3 | 4-7 | 8-15 | 16-31 | ...: buckets by powers of two."""
    return max(1, num_decodes).bit_length()


@dataclass
class StepCalibration:
    rate: float = 0.1  # weight of one step
    speculative: dict[int, float] = field(default_factory=dict)  # bucket -> measured / predicted, EWMA
    plain: dict[int, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 0.0 < self.rate <= 1.0:
            raise ValueError(f"rate must be in (0, 1], got {self.rate}")

    def observe(self, num_decodes: int, is_speculative: bool, predicted_s: float, measured_s: float) -> None:
        if predicted_s <= 0.0 or measured_s <= 0.0:
            return
        ratio = min(max(measured_s / predicted_s, RATIO_BOUNDS[0]), RATIO_BOUNDS[1])
        ratios = self.speculative if is_speculative else self.plain
        bucket = bucket_of(num_decodes)
        old = ratios.get(bucket)
        ratios[bucket] = ratio if old is None else old + self.rate * (ratio - old)

    def speculative_factor(self, num_decodes: int) -> float:
        """What a speculative plan's predicted time is multiplied by at this batch size: how much more its
        prediction has missed than a plain step's (1.0 until either has been measured there)."""
        bucket = bucket_of(num_decodes)
        speculative, plain = self.speculative.get(bucket), self.plain.get(bucket)
        if speculative is None or plain is None:
            return 1.0
        return speculative / plain
