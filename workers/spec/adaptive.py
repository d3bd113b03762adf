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
would bias alpha downwards for long drafts. When the sequence's own rate (its counts without the prior) stays
below `fallback_acceptance` for `fallback_patience_steps` steps in a row, it falls back to plain decoding for
good.
A step without drafts (the length policy chose zero, or n-gram lookup found nothing) tells nothing about
acceptance, so the estimate moves a little (`idle_recovery`) back toward the prior: otherwise a sequence
whose drafts missed a few times in a row would never be tried again, however well they would do later.

The prior is worth `prior_weight` tested tokens, always: alpha = (accepted + w * prior) / (tested + w) over
the sequence's weighted counts, so one early rejection cannot take a sequence that has nothing else to go
on from 0.6 to 0.25 (which kept EAGLE sequences, right at 0.8 acceptance, on plain decoding for 16 steps
after their first draft missed). Where timing may decide the lengths, the prior is the proposer's own
acceptance pooled over all its sequences (`PooledAcceptance`): a new sequence starts from what its proposer
achieves on this engine, and an idle one drifts back there, not to a constant. A seeded sampling request's
controller keeps the constant `initial_acceptance`, so its lengths depend on its own draws alone.
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class AdaptiveConfig:
    k_min: int = 1  # smallest k while speculating
    k_max: int = 8  # largest k
    initial_acceptance: float = 0.6  # prior alpha where no pooled estimate is given (seeded requests), or yet
    prior_weight: float = 2.0  # tested tokens the prior is worth in every estimate
    decay: float = 0.7  # weight past observations keep per step (EWMA); 0 = only the last step
    idle_recovery: float = 0.03  # share of the way back to the prior per step without drafts
    draft_cost_per_token: float = 0.1  # nominal cost of one more draft token, in target steps (seeded requests)
    fallback_acceptance: float = 0.2  # alpha below this makes a step poor
    fallback_patience_steps: int = 16  # consecutive poor steps before the sequence stops speculating

    def __post_init__(self) -> None:
        if not 1 <= self.k_min <= self.k_max:
            raise ValueError(f"need 1 <= k_min <= k_max, got {self.k_min}, {self.k_max}")
        if not 0.0 <= self.initial_acceptance <= 1.0:
            raise ValueError(f"initial_acceptance must be in [0, 1], got {self.initial_acceptance}")
        if self.prior_weight <= 0.0:
            raise ValueError(f"prior_weight must be > 0, got {self.prior_weight}")
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


class PooledAcceptance:
    """One proposer's acceptance over all the sequences it drafts for: accepted and tested draft tokens, each
    verified chain's counts added and older ones weighted down by `decay` per chain (about the last
    1 / (1 - decay) chains)."""

    def __init__(self, initial_acceptance: float, decay: float = 0.99, initial_weight: float = 8.0) -> None:
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"decay must be in [0, 1), got {decay}")
        self.decay = decay
        # the start is worth initial_weight tested tokens: the first sequence's first miss must not halve it
        self._num_accepted = initial_acceptance * initial_weight
        self._num_tested = initial_weight

    @property
    def acceptance(self) -> float:
        return self._num_accepted / self._num_tested

    def observe(self, num_accepted: int, num_tested: int) -> None:
        self._num_accepted = self.decay * self._num_accepted + num_accepted
        self._num_tested = self.decay * self._num_tested + num_tested


class SpecLengthController:
    """One sequence's acceptance estimate (and nominal k): call `update` after each verified chain.
    pool: its proposer's pooled acceptance, the prior it is shrunk toward and feeds; None = the constant
    initial_acceptance (a seeded request: its lengths must not depend on other requests)."""

    def __init__(self, config: AdaptiveConfig, pool: PooledAcceptance | None = None) -> None:
        self.config = config
        self.pool = pool
        self._num_accepted_ewma = 0.0  # weighted accepted draft tokens
        self._num_tested_ewma = 0.0  # weighted draft tokens the target judged
        self.num_poor_steps = 0  # consecutive steps with the sequence's own rate below fallback_acceptance
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
    def prior(self) -> float:
        return self.pool.acceptance if self.pool is not None else self.config.initial_acceptance

    @property
    def acceptance(self) -> float:
        """Estimated probability that the target accepts a draft token: the sequence's own counts, shrunk
        toward the prior by prior_weight tested tokens."""
        weight = self.config.prior_weight
        return (self._num_accepted_ewma + weight * self.prior) / (self._num_tested_ewma + weight)

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
        target = self.prior * self._num_tested_ewma
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
        if self.pool is not None:
            self.pool.observe(num_accepted, num_tested)
        # falling back is judged on the sequence's own record: the prior must not keep a useless draft going
        is_poor = self._num_accepted_ewma < self.config.fallback_acceptance * self._num_tested_ewma
        self.num_poor_steps = self.num_poor_steps + 1 if is_poor else 0
        if self.num_poor_steps >= self.config.fallback_patience_steps:
            self.is_fallen_back = True
            self._k = 0
            return True
        self._k = None
        return False

