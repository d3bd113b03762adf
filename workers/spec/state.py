"""Per-sequence speculation state, and acceptance counters shared by sequences and the engine."""

from dataclasses import dataclass, field

from shared.speculation import SpeculativeMethod
from workers.spec.adaptive import SpecLengthController
from workers.spec.ngram import NgramIndex


@dataclass
class AcceptanceCounts:
    num_steps: int = 0  # verification steps that carried draft tokens
    num_drafted: int = 0  # draft tokens (tree: nodes) proposed
    num_accepted: int = 0
    num_emitted: int = 0  # tokens those steps emitted: accepted + one recovered/bonus each
    drafted_per_position: list[int] = field(default_factory=list)  # [positions] draft depth i was verified
    accepted_per_position: list[int] = field(default_factory=list)  # [positions] draft depth i was accepted

    def record(self, num_drafted: int, num_accepted: int, depth: int) -> None:
        """One verified step; `depth` = draft positions along the longest proposed path."""
        self.num_steps += 1
        self.num_drafted += num_drafted
        self.num_accepted += num_accepted
        self.num_emitted += num_accepted + 1
        missing = depth - len(self.drafted_per_position)
        if missing > 0:
            self.drafted_per_position.extend([0] * missing)
            self.accepted_per_position.extend([0] * missing)
        for i in range(depth):
            self.drafted_per_position[i] += 1
            self.accepted_per_position[i] += int(i < num_accepted)

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted / self.num_drafted if self.num_drafted else 0.0

    @property
    def mean_accepted_tokens(self) -> float:
        """tau: tokens emitted per target forward while speculating."""
        return self.num_emitted / self.num_steps if self.num_steps else 1.0

    def per_position_acceptance(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_position, self.drafted_per_position, strict=True)]


@dataclass
class SpecState:
    method: SpeculativeMethod  # DRAFT or NGRAM (a NONE request has no SpecState)
    controller: SpecLengthController
    ngram: NgramIndex | None  # prompt-lookup index over the committed tokens (ngram method)
    draft_num_computed: int = 0  # tokens whose K/V are valid in the draft cache
    counts: AcceptanceCounts = field(default_factory=AcceptanceCounts)
    fallback_reason: str | None = None  # set once the sequence decodes plainly for good

    @property
    def is_active(self) -> bool:
        return self.fallback_reason is None

    def fall_back(self, reason: str) -> None:
        self.fallback_reason = reason
        self.controller.is_fallen_back = True
        self.controller.k = 0

    def metrics(self) -> dict[str, float]:
        return {
            "mean_accepted_tokens": self.counts.mean_accepted_tokens,
            "acceptance_rate": self.counts.acceptance_rate,
            "num_spec_steps": float(self.counts.num_steps),
            "num_draft_tokens": float(self.counts.num_drafted),
            "num_accepted_tokens": float(self.counts.num_accepted),
            "spec_fallback": float(self.fallback_reason is not None),
        }


@dataclass
class SpecStats:
    """Engine-wide speculation figures since start (the worker exports them to Prometheus)."""

    counts: AcceptanceCounts = field(default_factory=AcceptanceCounts)
    accepted_length_histogram: dict[int, int] = field(default_factory=dict)  # accepted per seq-step -> count
    num_fallbacks: int = 0
    draft_time_s: float = 0.0
    verify_time_s: float = 0.0  # target forward + verification, in steps that carried draft tokens

    def record(self, num_drafted: int, num_accepted: int, depth: int) -> None:
        self.counts.record(num_drafted, num_accepted, depth)
        self.accepted_length_histogram[num_accepted] = self.accepted_length_histogram.get(num_accepted, 0) + 1
