"""One sequence's acceptance estimate, and its speculation length where timing must not decide it.

Per sequence, `SpecLengthController` keeps an exponentially weighted estimate of the per-token acceptance
probability alpha. The engine chooses each step's lengths from it and from costs measured on this host
(length_policy.py). The controller's own `k` - the k in [k_min, k_max] with the most expected tokens per
unit of a *nominal* cost,
    tokens(k) = 1 + alpha + ... + alpha^k = (1 - alpha^(k+1)) / (1 - alpha)   (accepted + the one emitted)
    cost(k)   = 1 + draft_cost_per_token * k                                 (in target decode steps)
- is used only where the length must not depend on timing: a seeded sampling request, whose draws (and so
its output) depend on how many tokens each step drafts, must reproduce on any host and under any load.
The estimate counts *tested* positions: after the first rejection the rest of the draft was never judged,
so a step with n accepted of k drafted is n successes in n + (1 if n < k) trials - dividing by k instead
would bias alpha downwards for long drafts. When the estimate stays below `fallback_acceptance` for
`fallback_patience_steps` steps in a row, the sequence falls back to plain decoding for good.
A step without drafts (the length policy chose zero, or n-gram lookup found nothing) tells nothing about
acceptance, so the estimate moves a little (`idle_recovery`) back toward the prior: otherwise a sequence
whose drafts missed a few times in a row would never be tried again, however well they would do later.
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class AdaptiveConfig:
    k_min: int = 1  # smallest k while speculating
    k_max: int = 8  # largest k
    initial_acceptance: float = 0.6  # prior alpha, worth one tested token
    decay: float = 0.7  # weight past observations keep per step (EWMA); 0 = only the last step
    idle_recovery: float = 0.03  # share of the way back to initial_acceptance per step without drafts
    draft_cost_per_token: float = 0.1  # nominal cost of one more draft token, in target steps (seeded requests)
    fallback_acceptance: float = 0.2  # alpha below this makes a step poor
    fallback_patience_steps: int = 16  # consecutive poor steps before the sequence stops speculating

    def __post_init__(self) -> None:
        if not 1 <= self.k_min <= self.k_max:
            raise ValueError(f"need 1 <= k_min <= k_max, got {self.k_min}, {self.k_max}")
        if not 0.0 <= self.initial_acceptance <= 1.0:
            raise ValueError(f"initial_acceptance must be in [0, 1], got {self.initial_acceptance}")
        if not 0.0 <= self.idle_recovery <= 1.0:
            raise ValueError(f"idle_recovery must be in [0, 1], got {self.idle_recovery}")
        if not 0.0 <= self.decay < 1.0:
            raise ValueError(f"decay must be in [0, 1), got {self.decay}")
        if not self.draft_cost_per_token > 0.0:
            raise ValueError(f"draft_cost_per_token must be > 0, got {self.draft_cost_per_token}")
        if not 0.0 <= self.fallback_acceptance < 1.0:
            raise ValueError(f"fallback_acceptance must be in [0, 1), got {self.fallback_acceptance}")
        if self.fallback_patience_steps < 1:
            raise ValueError(f"fallback_patience_steps must be >= 1, got {self.fallback_patience_steps}")


def expected_tokens_per_cost(acceptance: float, k: int, draft_cost_per_token: float) -> float:
    """Tokens emitted per step (accepted + 1) divided by the step's cost, for per-token acceptance alpha."""
    num_tokens = k + 1.0 if acceptance >= 1.0 else (1.0 - acceptance ** (k + 1)) / (1.0 - acceptance)
    return num_tokens / (1.0 + draft_cost_per_token * k)


def best_k(acceptance: float, config: AdaptiveConfig) -> int:
    """The k in [k_min, k_max] with the most tokens per cost; the smallest such k on ties."""
    ks = range(config.k_min, config.k_max + 1)
    return max(ks, key=lambda k: (expected_tokens_per_cost(acceptance, k, config.draft_cost_per_token), -k))


class SpecLengthController:
    """One sequence's acceptance estimate (and nominal k): call `update` after each verified chain."""

    def __init__(self, config: AdaptiveConfig) -> None:
        self.config = config
        self._num_accepted_ewma = config.initial_acceptance  # weighted accepted draft tokens
        self._num_tested_ewma = 1.0  # weighted draft tokens the target judged
        self.num_poor_steps = 0  # consecutive steps with acceptance below fallback_acceptance
        self.is_fallen_back = False  # True: plain decoding from now on
        # token trees: the same kind of estimate for passing one tree level (None until a tree was verified)
        self._levels_passed_ewma = 0.0
        self._levels_tested_ewma = 0.0
        self._k: int | None = None  # the nominal k, worked out when read (most sequences never read it)

    @property
    def k(self) -> int:
        """The nominal k for the current estimate; 0 once fallen back."""
        if self._k is None:
            self._k = 0 if self.is_fallen_back else best_k(self.acceptance, self.config)
        return self._k

    @k.setter
    def k(self, value: int) -> None:
        """Pin k until the estimate next changes."""
        self._k = value

    @property
    def acceptance(self) -> float:
        """Estimated probability that the target accepts a draft token."""
        return self._num_accepted_ewma / self._num_tested_ewma

    @property
    def tree_level_acceptance(self) -> float | None:
        """Estimated probability that a verified tree passes one more level (None: no tree verified yet)."""
        return self._levels_passed_ewma / self._levels_tested_ewma if self._levels_tested_ewma else None

    def update_tree(self, depth: int, num_accepted: int) -> None:
        """Record one verified tree: num_accepted levels of its `depth` passed, the next one (if any) failed."""
        if not 0 <= num_accepted <= depth:
            raise ValueError(f"need 0 <= num_accepted <= depth, got {num_accepted}, {depth}")
        decay = self.config.decay
        self._levels_passed_ewma = decay * self._levels_passed_ewma + num_accepted
        self._levels_tested_ewma = decay * self._levels_tested_ewma + num_accepted + (1 if num_accepted < depth else 0)

    def idle(self) -> None:
        """One step without drafts: the estimate moves idle_recovery of the way back to the prior."""
        if self.is_fallen_back:
            return
        target = self.config.initial_acceptance * self._num_tested_ewma
        self._num_accepted_ewma += self.config.idle_recovery * (target - self._num_accepted_ewma)
        self._k = None

    def update(self, num_drafted: int, num_accepted: int) -> bool:
        """Record one verified step; returns True exactly on the step this sequence falls back (count it)."""
        if not 0 <= num_accepted <= num_drafted:
            raise ValueError(f"need 0 <= num_accepted <= num_drafted, got {num_accepted}, {num_drafted}")
        if self.is_fallen_back or num_drafted == 0:
            return False
        num_tested = num_accepted + (1 if num_accepted < num_drafted else 0)  # judged positions
        decay = self.config.decay
        self._num_accepted_ewma = decay * self._num_accepted_ewma + num_accepted
        self._num_tested_ewma = decay * self._num_tested_ewma + num_tested
        is_poor = self.acceptance < self.config.fallback_acceptance
        self.num_poor_steps = self.num_poor_steps + 1 if is_poor else 0
        if self.num_poor_steps >= self.config.fallback_patience_steps:
            self.is_fallen_back = True
            self._k = 0
            return True
        self._k = None
        return False

