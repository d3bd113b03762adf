"""Per-sequence speculation state, and acceptance counters shared by sequences and the engine."""

from dataclasses import dataclass, field

import torch

from shared.speculation import SpeculativeMethod
from workers.spec.adaptive import SpecLengthController
from workers.spec.ngram import NgramIndex


@dataclass
class AcceptanceCounts:
    num_steps: int = 0  # verification steps that carried draft tokens
    num_drafted: int = 0  # draft tokens (tree: nodes) proposed
    num_accepted: int = 0
    num_emitted: int = 0  # tokens those steps emitted: accepted + one recovered/bonus each
    num_rejected: int = 0  # steps whose target rejected a draft token (one at most: the first ends the path)
    drafted_per_position: list[int] = field(default_factory=list)  # [positions] draft depth i was verified
    accepted_per_position: list[int] = field(default_factory=list)  # [positions] draft depth i was accepted

    def record(self, num_drafted: int, num_accepted: int, depth: int, is_rejected: bool | None = None) -> None:
        """One verified step; `depth` = draft positions along the longest proposed path; `is_rejected`: the target
        rejected a draft token (a tree's accepted path ended at a node with children; None: num_accepted < depth,
        exact for a chain)."""
        self.num_steps += 1
        self.num_drafted += num_drafted
        self.num_accepted += num_accepted
        self.num_emitted += num_accepted + 1
        self.num_rejected += int(num_accepted < depth if is_rejected is None else is_rejected)
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
    def rejection_rate(self) -> float:
        """Of the draft tokens the target judged, the share it rejected: 1 - alpha, the per-token acceptance of
        Leviathan et al. A path is judged up to its first rejection; the draft tokens after it were never tested,
        so they count in neither part (acceptance_rate counts them as not accepted, and so falls with k)."""
        num_judged = self.num_accepted + self.num_rejected
        return self.num_rejected / num_judged if num_judged else 0.0

    @property
    def mean_accepted_tokens(self) -> float:
        """tau: tokens emitted per target forward while speculating."""
        return self.num_emitted / self.num_steps if self.num_steps else 1.0

    def per_position_acceptance(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_position, self.drafted_per_position, strict=True)]


@dataclass
class SpecState:
    method: SpeculativeMethod  # DRAFT, NGRAM or EAGLE (a NONE request has no SpecState)
    controller: SpecLengthController
    ngram: NgramIndex | None  # prompt-lookup index over the committed tokens (ngram method)
    # tokens whose K/V are valid in the draft cache; EAGLE: head rows (row t reads feature t and token t + 1)
    draft_num_computed: int = 0
    counts: AcceptanceCounts = field(default_factory=AcceptanceCounts)
    fallback_reason: str | None = None  # set once the sequence decodes plainly for good
    # EAGLE: the target's features of committed positions the head has not consumed yet, kept from the target
    # passes that computed them: rows for positions features_start .. features_start + len - 1
    features: torch.Tensor | None = None  # [m, hidden]
    features_start: int = 0

    @property
    def is_active(self) -> bool:
        return self.fallback_reason is None

    @property
    def wants_features(self) -> bool:
        return self.method is SpeculativeMethod.EAGLE and self.is_active

    @property
    def features_end(self) -> int:
        """One past the last position with a kept feature."""
        return self.features_start + (0 if self.features is None else int(self.features.shape[0]))

    def keep_features(self, start: int, rows: torch.Tensor) -> None:  # rows: [n, hidden] for start .. start + n - 1
        """Append the features of committed positions; a gap (never expected) restarts the kept run."""
        if rows.shape[0] == 0:
            return
        if self.features is None or start != self.features_end:
            self.features, self.features_start = rows.clone(), start
        else:
            self.features = torch.cat([self.features, rows])

    def drop_features_before(self, position: int) -> None:
        """Forget features of positions before `position` (the head's cache holds their rows now)."""
        if self.features is None or position <= self.features_start:
            return
        if position >= self.features_end:
            self.features = None
        else:
            self.features = self.features[position - self.features_start :].clone()
        self.features_start = position

    def drop_kv(self) -> None:
        """The sequence lost its KV (preemption): the draft or head recomputes from the start."""
        self.draft_num_computed = 0
        self.features, self.features_start = None, 0

    def fall_back(self, reason: str) -> None:
        self.fallback_reason = reason
        self.controller.is_fallen_back = True
        self.controller.k = 0
        self.features = None

    def metrics(self) -> dict[str, float]:
        return {
            "mean_accepted_tokens": self.counts.mean_accepted_tokens,
            "acceptance_rate": self.counts.acceptance_rate,
            "draft_rejection_rate": self.counts.rejection_rate,
            "num_spec_steps": float(self.counts.num_steps),
            "num_draft_tokens": float(self.counts.num_drafted),
            "num_accepted_tokens": float(self.counts.num_accepted),
            "spec_fallback": float(self.fallback_reason is not None),
        }


@dataclass
class MethodStats:
    """One speculation method's share of the engine-wide figures."""

    counts: AcceptanceCounts = field(default_factory=AcceptanceCounts)
    draft_time_s: float = 0.0  # time its proposer spent (n-gram lookups are not timed)


@dataclass
class SpecStats:
    """Engine-wide speculation figures since start (the worker exports them to Prometheus)."""

    counts: AcceptanceCounts = field(default_factory=AcceptanceCounts)
    accepted_length_histogram: dict[int, int] = field(default_factory=dict)  # accepted per seq-step -> count
    num_fallbacks: int = 0
    draft_time_s: float = 0.0
    verify_time_s: float = 0.0  # target forward + verification, in steps that carried draft tokens
    methods: dict[SpeculativeMethod, MethodStats] = field(default_factory=dict)  # method -> its own figures

    def by_method(self, method: SpeculativeMethod) -> MethodStats:
        return self.methods.setdefault(method, MethodStats())

    def record(
        self,
        num_drafted: int,
        num_accepted: int,
        depth: int,
        method: SpeculativeMethod | None = None,
        is_rejected: bool | None = None,
    ) -> None:
        self.counts.record(num_drafted, num_accepted, depth, is_rejected)
        self.accepted_length_histogram[num_accepted] = self.accepted_length_histogram.get(num_accepted, 0) + 1
        if method is not None:
            self.by_method(method).counts.record(num_drafted, num_accepted, depth, is_rejected)
