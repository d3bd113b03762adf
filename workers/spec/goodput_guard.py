"""Speculation held to what it delivers: the tokens per second speculative steps realised, against plain ones.

The length policy (length_policy.py) predicts a step's goodput from pass costs and acceptance estimates. What
it cannot see, it cannot price: a proposer's backlog after steps it sat out, the cache effects of a longer
pass, verification that costs more at one batch size than the fit says. So its plans are checked against
what they realised. `GoodputGuard` keeps, per key, exponentially weighted sums of the tokens emitted and the
seconds taken by steps that verified draft tokens and by steps that did not. A key is a batch-size bucket,
whether the step carries prefill chunks (a prompt makes a step dearer whatever it drafts, so such steps are
compared among themselves) and the proposers in the batch.

Once both kinds have been seen `min_samples` times and speculative steps delivered fewer tokens per second
(ratio r < 1 of the plain steps') by more than the steps' spread explains (a step's time varies by tens of
percent on a shared host), the key is vetoed: its steps decode plainly without being planned, except one
*trial* in `interval` steps that the policy plans as before, so the comparison stays current when the host,
the load or the acceptance changes: a trial's speculative step weighs `trial_weight` in its average, since
the rest of that average is as old as the veto, and a veto on a slow minute must not outlive it. A trial
takes q times a plain step (q: the two kinds' mean step times) and delivers r of the plain rate over it, so
it loses q (1 - r) of a plain step; one trial in n steps costs max_regret of the time where
    n = 1 + ceil(q ((1 - r) / max_regret - 1))
a near tie is retried almost every step, a clear loss seldom (never less than once in `max_interval` steps).
q matters: a trial carries every sequence's drafts, and at 4 sequences on a compute-bound CPU such a step
took 3.7x a plain one (demo target + EAGLE head, 2-core AVX512-BF16 host, 2026-12-07), so trials spaced as if
q were 1 cost ~4 % of the time where 1 % was meant. Where speculation pays, nothing changes: the policy's own
zero-length steps keep the plain side measured.
"""

import math
from dataclasses import dataclass, field

Key = tuple[int, bool, tuple[str, ...]]  # (batch-size bucket, with prefill chunks, proposers of the batch)


def guard_key(num_decodes: int, has_prefill: bool, methods: tuple[str, ...]) -> Key:
    """Batch sizes 1, 2, 3-4, 5-8, 9-16, ... share a key: steps near one size cost alike."""
    return (max(0, num_decodes - 1).bit_length(), has_prefill, methods)


@dataclass
class _Rate:
    """Weighted averages over one kind of step: tokens and seconds (their ratio is its tokens per second), and
    each step's own tokens per second with its square (their spread says how far that ratio can be trusted)."""

    weight: float
    num_tokens: float = 0.0
    seconds: float = 0.0
    step_rate: float = 0.0
    step_rate_sq: float = 0.0
    num_samples: int = 0
    weight_sq: float = 0.0  # sum of the squared weights the steps now hold: 1 / (the steps the average is worth)

    def observe(self, num_tokens: int, seconds: float, weight: float | None = None) -> None:
        """The first 1 / weight steps are averaged alike (a running mean), later ones with `weight`: a few early
        steps must not stand for the whole, nor should a long run forget that the host or the text changed. A
        step may weigh more (`weight`): a vetoed key's trial, the only fresh word on its speculative steps."""
        self.num_samples += 1
        weight = max(self.weight if weight is None else weight, 1.0 / self.num_samples)
        self.weight_sq = (1.0 - weight) ** 2 * self.weight_sq + weight * weight
        rate = num_tokens / seconds
        self.num_tokens += weight * (num_tokens - self.num_tokens)
        self.seconds += weight * (seconds - self.seconds)
        self.step_rate += weight * (rate - self.step_rate)
        self.step_rate_sq += weight * (rate * rate - self.step_rate_sq)

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def variance_of_mean(self) -> float:
        """Squared standard error of step_rate: the steps' variance over as many steps as the average is worth
        (Kish's effective sample size, 1 / the sum of the squared weights)."""
        return max(0.0, self.step_rate_sq - self.step_rate**2) * self.weight_sq


@dataclass
class _KeyState:
    speculative: _Rate
    plain: _Rate
    steps_since_trial: int = 0
    is_on_trial: bool = False  # the key's last allowed step was a trial of a veto


@dataclass
class GoodputGuard:
    weight: float = 0.02  # weight of one step in the averages, once 1 / weight steps were seen
    min_samples: int = 8  # steps of each kind a key needs before it can be vetoed
    confidence_z: float = 2.0  # standard errors by which speculative steps must fall short before a veto
    max_regret: float = 0.01  # share of the time trials of a vetoed key may cost
    max_interval: int = 256  # a vetoed key is tried at least once in this many steps
    trial_weight: float = 0.2  # weight of a trial step in its key's speculative average
    _keys: dict[Key, _KeyState] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 0.0 < self.weight <= 1.0:
            raise ValueError(f"weight must be in (0, 1], got {self.weight}")
        if not 0.0 < self.max_regret < 1.0:
            raise ValueError(f"max_regret must be in (0, 1), got {self.max_regret}")
        if self.min_samples < 1 or self.max_interval < 1:
            raise ValueError(f"min_samples and max_interval must be >= 1, got {self.min_samples}, {self.max_interval}")
        if self.confidence_z < 0.0:
            raise ValueError(f"confidence_z must be >= 0, got {self.confidence_z}")
        if not self.weight <= self.trial_weight <= 1.0:
            raise ValueError(f"trial_weight must be in [weight, 1], got {self.trial_weight}")

    def ratio(self, key: Key) -> float | None:
        """Speculative steps' tokens per second over plain steps' for this key; None until both were seen
        min_samples times."""
        state = self._keys.get(key)
        if state is None or min(state.speculative.num_samples, state.plain.num_samples) < self.min_samples:
            return None
        plain = state.plain.tokens_per_s
        return state.speculative.tokens_per_s / plain if plain > 0 else None

    def interval(self, ratio: float, step_time_ratio: float = 1.0) -> int:
        """Steps between trials of a key whose speculative steps deliver `ratio` of its plain steps' goodput
        and take `step_time_ratio` times as long: the fewest that keep trials to max_regret of the time."""
        extra = max(0.0, step_time_ratio * ((1.0 - ratio) / self.max_regret - 1.0))
        # less a hair: a whole number of steps computed as 9.000000000000002 (float rounding) stays 9, not 10
        return max(1, min(self.max_interval, 1 + math.ceil(extra - 1e-9)))

    def is_vetoed(self, key: Key) -> bool:
        """Speculative steps of `key` delivered fewer tokens per second than plain ones, and by more than the
        steps' spread explains (confidence_z standard errors of the two mean step rates)."""
        return self._vetoed_ratio(key) is not None

    def _vetoed_ratio(self, key: Key) -> float | None:
        """The key's ratio where it is vetoed (see is_vetoed); None where it is not."""
        ratio = self.ratio(key)
        if ratio is None or ratio >= 1.0:
            return None
        state = self._keys[key]
        spec, plain = state.speculative, state.plain
        margin = self.confidence_z * math.sqrt(spec.variance_of_mean + plain.variance_of_mean)
        return ratio if plain.step_rate - spec.step_rate > margin else None

    def allows(self, key: Key) -> bool:
        """May this step of `key` speculate? Called once per planned step."""
        ratio = self._vetoed_ratio(key)
        if ratio is None:
            return True
        state = self._keys[key]
        state.steps_since_trial += 1
        if state.steps_since_trial >= self.interval(ratio, state.speculative.seconds / state.plain.seconds):
            state.steps_since_trial = 0
            state.is_on_trial = True
            return True
        return False

    def observe(self, key: Key, is_speculative: bool, num_tokens: int, seconds: float) -> None:
        """One step of `key`: num_tokens emitted in `seconds`."""
        if num_tokens <= 0 or seconds <= 0.0:
            return
        state = self._keys.get(key)
        if state is None:
            state = self._keys[key] = _KeyState(_Rate(self.weight), _Rate(self.weight))
        if is_speculative:
            state.speculative.observe(num_tokens, seconds, self.trial_weight if state.is_on_trial else None)
        else:
            state.plain.observe(num_tokens, seconds)
        state.is_on_trial = False
