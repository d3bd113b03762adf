"""What a forward pass costs on this host, as a function of the tokens in it and the context they attend to:
measured, never configured.

A pass's time is taken as a dense part that depends on its token count alone, plus attention over the
sequences' committed context (`AttentionWork`): per committed key a sequence's rows read (`s_per_key`, K/V
brought in once) and per query row times those keys (`s_per_pair`). The two rates come from a start-up probe of
the same passes at two context lengths (workers/engine/cost_probe.py), so a table point measured while
contexts were short is not read as the cost of the same pass over long ones: at 16 sequences on the demo
target a decode pass took 5.8 ms over 32 committed tokens each and 9.7 ms over 512, and a verify of 4 rows each
11.7 and 20.4 ms. Only the dense part is tabled; an estimate adds the attention of the pass asked about.

`PassCostTable` keeps the dense time in seconds at a grid of token counts (1, 2, 3, 4, 6, 8, 12, 16, ... 2048)
and answers any count by linear interpolation between its two grid neighbours (past the grid's ends: the
nearest point, scaled by tokens above the grid). It is filled by timing real passes: the engine probes a few
sizes at start-up (workers/engine/cost_probe.py) and then feeds it every pass it runs. Estimates read the
table's lower envelope - a pass is never taken to cost more than a bigger one, nor more than the smaller
passes it could be split into (n tokens <= ceil(n / m) passes of m) - so one stalled measurement (another
process held the core) cannot make a size look dear for good, even a size no step runs again because it
looked dear (a head probed during a stall would otherwise never draft, and never be re-measured). An observation of n
tokens that took t seconds corrects the two neighbours of n by the ratio of t to their estimate, each in
proportion to its interpolation weight (an exponentially weighted average per point), so the table tracks
the host as it is now: a noisy neighbour, a compiled path.

Costs are only compared within one table and between tables of the same process, so what matters is that
ratios hold - the absolute times drift with the host.
"""

import bisect
from dataclasses import dataclass, field

MIN_DENSE_SHARE = 0.25  # the attention taken out of an observed pass leaves at least this share of it
PAIR_ROWS_CAP = 64  # a verify chain or tree (at most 63 nodes); a longer prefill chunk's rows attend as a block


@dataclass(frozen=True)
class AttentionWork:
    """The attention over committed context in one pass: keys = sum over its sequences of the committed tokens
    they attend to; pairs = sum of query rows x those keys (rows past a chunk's first PAIR_ROWS_CAP are left to
    the dense part, as the probe that measures the rates does not reach them)."""

    num_keys: int = 0
    num_pairs: int = 0

    def __add__(self, other: "AttentionWork") -> "AttentionWork":
        return AttentionWork(self.num_keys + other.num_keys, self.num_pairs + other.num_pairs)

    @staticmethod
    def of_rows(num_rows: int, num_context_tokens: int) -> "AttentionWork":
        """One sequence's share: num_rows query rows over num_context_tokens committed tokens."""
        return AttentionWork(num_context_tokens, num_pairs(num_rows, num_context_tokens))


def num_pairs(num_rows: int, num_context_tokens: int) -> int:
    """A sequence's query rows x committed keys, as AttentionWork counts them (up to PAIR_ROWS_CAP rows)."""
    return min(num_rows, PAIR_ROWS_CAP) * num_context_tokens


NO_ATTENTION = AttentionWork()


@dataclass(frozen=True)
class PassTiming:
    """One timed forward of a runner, as it reports it to the cost tables."""

    num_tokens: int
    seconds: float
    work: AttentionWork = NO_ATTENTION
    # the runner never ran this shape (tokens, logits rows) before: `seconds` holds one-time set-up (oneDNN
    # creates its matmul primitives per shape: ~4 ms a new token count on the demo target, against 8-9 ms a pass),
    # not what the shape costs from then on
    is_first_of_shape: bool = False


@dataclass(frozen=True)
class AttentionCost:
    """Seconds per committed key a pass's sequences read, and per query row x key (cost_probe.py measures both)."""

    s_per_key: float = 0.0
    s_per_pair: float = 0.0

    def seconds(self, work: AttentionWork) -> float:
        return self.s_per_key * work.num_keys + self.s_per_pair * work.num_pairs


def _grid(max_tokens: int) -> list[int]:
    """1 2 3 4 6 8 12 16 24 32 ... up to max_tokens: fine where the thread policy and dispatch change costs."""
    points = [1, 2, 3, 4]
    while points[-1] < max_tokens:
        last = points[-1]
        points.append(last * 3 // 2 if last & (last - 1) == 0 else last * 4 // 3)
    return points


@dataclass
class PassCostTable:
    max_tokens: int = 2048  # the grid's last point; larger passes are extrapolated from it
    rate: float = 0.2  # weight of one observation at a grid point it falls on
    attention: AttentionCost = AttentionCost()  # set by the start-up probe, before the first observation
    grid: list[int] = field(init=False)  # [G] token counts
    seconds: list[float | None] = field(init=False)  # [G] estimated dense pass time; None = never measured
    _measured: tuple[list[int], list[float]] = field(init=False, repr=False)  # the measured points, for estimate_s
    _is_stale: bool = field(init=False, repr=False)  # observed since _measured was made: remake it when read
    _observed_at: list[int] = field(init=False, repr=False)  # [G] the observation that last moved each point
    _num_observed: int = field(init=False, repr=False)  # observations so far
    _split_key: tuple[int, ...] = field(init=False, repr=False)  # the measured token counts _split_counts is of
    _split_counts: list[list[int]] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not 0.0 < self.rate <= 1.0:
            raise ValueError(f"rate must be in (0, 1], got {self.rate}")
        self.grid = _grid(self.max_tokens)
        self.seconds = [None] * len(self.grid)
        self._measured = ([], [])
        self._is_stale = False
        self._observed_at = [0] * len(self.grid)
        self._num_observed = 0
        self._split_key, self._split_counts = (), []

    @property
    def is_measured(self) -> bool:
        return any(s is not None for s in self.seconds)

    def estimate_s(self, num_tokens: int, work: AttentionWork = NO_ATTENTION) -> float:
        """Seconds a pass of num_tokens with attention `work` takes (0 for none); needs one measured point."""
        if num_tokens <= 0:
            return 0.0
        return self._dense_s(num_tokens) + self.attention.seconds(work)

    def _dense_s(self, num_tokens: int) -> float:
        tokens, seconds = self._measured if not self._is_stale else self._envelope()  # the planner's hot path
        if not tokens:
            raise ValueError("no pass has been measured yet")
        i = bisect.bisect_left(tokens, num_tokens)
        if i < len(tokens) and tokens[i] == num_tokens:
            return seconds[i]
        if i == 0:  # below the smallest measured count: a pass costs at least what the smallest one does
            return seconds[0]
        if i == len(tokens):  # above the largest: the last point, growing with tokens at the last slope
            slope = (seconds[-1] - seconds[-2]) / (tokens[-1] - tokens[-2]) if len(tokens) > 1 else seconds[-1] / tokens[-1]
            return seconds[-1] + max(slope, 0.0) * (num_tokens - tokens[-1])
        g0, g1, s0, s1 = tokens[i - 1], tokens[i], seconds[i - 1], seconds[i]
        return s0 + (s1 - s0) * (num_tokens - g0) / (g1 - g0)

    def min_slope_s(self, num_tokens: int) -> float:
        """Seconds per token the estimate grows at least from num_tokens on: the smallest slope of the dense
        envelope's segments that reach past num_tokens, the extrapolation's included (0 where it is flat);
        a token's attention only adds to it."""
        tokens, seconds = self._envelope()
        if len(tokens) < 2 or num_tokens < tokens[0]:  # below the first point the estimate is flat
            return 0.0
        slopes = [
            (seconds[i + 1] - seconds[i]) / (tokens[i + 1] - tokens[i])
            for i in range(len(tokens) - 1)
            if tokens[i + 1] > num_tokens
        ]
        last = (seconds[-1] - seconds[-2]) / (tokens[-1] - tokens[-2])  # the slope past the last point
        return max(0.0, min(slopes + [last]))

    def observe(self, num_tokens: int, seconds: float, work: AttentionWork = NO_ATTENTION) -> None:
        """One timed pass: a new grid point is set outright; measured ones move toward what its dense part implies."""
        if num_tokens <= 0 or seconds <= 0.0:
            return
        seconds = max(seconds - self.attention.seconds(work), MIN_DENSE_SHARE * seconds)
        neighbours = self._neighbours(num_tokens)
        known: list[tuple[int, float, float]] = []  # (grid index, weight, its time) of the measured neighbours
        for index, weight in neighbours:
            old = self.seconds[index]
            if old is not None:
                known.append((index, weight, old))
        raw_estimate = sum(w * old for _, w, old in known) / sum(w for _, w, _ in known) if known else 0.0
        self._num_observed += 1
        for index, weight, old in known:  # the raw points, not the envelope: a stalled point must recover
            self.seconds[index] = old * (1.0 + self.rate * weight * (seconds / raw_estimate - 1.0))
            self._observed_at[index] = self._num_observed
        for index, weight in neighbours:
            if self.seconds[index] is None and weight >= 0.5:  # unmeasured: learns from the nearer side only
                scale = self.grid[index] / num_tokens if num_tokens > self.max_tokens else 1.0
                self.seconds[index] = seconds * scale
                self._observed_at[index] = self._num_observed
        self._is_stale = True  # every pass is observed (the draft's up to k a step): the envelope waits for a read

    def _envelope(self) -> tuple[list[int], list[float]]:
        """The measured points' envelope (token counts, seconds), remade after observations. A pass never costs
        more than a bigger one: where a smaller size measured dearer, the one measured more recently wins (a
        stall made the smaller one dear; or the host slowed since the bigger one, last measured at start-up,
        and not raised it would cap every size below it at what it cost then)."""
        if not self._is_stale:
            return self._measured
        tokens: list[int] = []
        envelope: list[float] = []
        observed_at: list[int] = []
        for g, s, at in zip(self.grid, self.seconds, self._observed_at, strict=True):
            if s is not None:
                tokens.append(g)
                envelope.append(s)
                observed_at.append(at)
        n = len(envelope)
        # capped by the bigger passes measured since it was: by the least of them as measured (a cap's own cap
        # was measured later still, so it is among them). Loops, no list a point: this runs after every step's
        # observations, in the planner's path, for each table (22 points: 32 against 69 us with a list a point;
        # EAGLE at one sequence 1.008-1.047x tokens/s, stepped in turn, 2026-12-06)
        measured_s = list(envelope)
        for i in range(n - 1):
            at_i, least = observed_at[i], envelope[i]
            for j in range(i + 1, n):
                if observed_at[j] >= at_i and measured_s[j] < least:
                    least = measured_s[j]
            envelope[i] = least
        for i in range(1, n):  # raised to a smaller pass measured since it was
            if observed_at[i] < observed_at[i - 1]:
                envelope[i] = max(envelope[i], envelope[i - 1])
                observed_at[i] = observed_at[i - 1]  # it now stands for that measurement
        splits = self._splits(tokens)
        for i in range(1, n):  # nor more than the smaller passes it could be split into
            least = envelope[i]
            for j, num_parts in enumerate(splits[i]):
                split_s = num_parts * envelope[j]
                if split_s < least:
                    least = split_s
            envelope[i] = least
        self._measured, self._is_stale = (tokens, envelope), False
        return self._measured

    def _splits(self, tokens: list[int]) -> list[list[int]]:
        """[i][j] for j < i: how many passes of tokens[j] a pass of tokens[i] splits into (kept while the measured
        points stay the same)."""
        key = tuple(tokens)
        if self._split_key != key:
            self._split_key = key
            self._split_counts = [[-(-t // tokens[j]) for j in range(i)] for i, t in enumerate(tokens)]
        return self._split_counts

    def _neighbours(self, num_tokens: int) -> list[tuple[int, float]]:
        """(grid index, interpolation weight) of the grid points around num_tokens."""
        i = bisect.bisect_left(self.grid, num_tokens)
        if i < len(self.grid) and self.grid[i] == num_tokens:
            return [(i, 1.0)]
        if i == len(self.grid):
            return [(i - 1, 1.0)]
        g0, g1 = self.grid[i - 1], self.grid[i]
        w1 = (num_tokens - g0) / (g1 - g0)
        return [(i - 1, 1.0 - w1), (i, w1)]

    def snapshot(self) -> dict[int, float]:
        """token count -> estimated ms of the dense part, for the measured grid points (logs, bench JSON)."""
        return {g: s * 1e3 for g, s in zip(*self._envelope(), strict=True)}
