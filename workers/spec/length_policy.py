"""Speculation lengths for one step, chosen from measured costs (SmartSpec's goodput, per step).

Each decoding sequence that may speculate is a `Candidate` with its acceptance estimate alpha (per draft
token, see adaptive.SpecLengthController). A chain of k draft tokens emits, in expectation,
    1 + alpha + alpha^2 + ... + alpha^k   tokens   (the j-th draft token is kept with probability alpha^j)
so the j-th draft token of sequence i is worth gain(i, j) = alpha_i^j tokens. The step costs
    target(n_base + sum_i k_i, attention)  +  sum over proposers m, depths j of  proposer_m(its j-th pass)
where target() and proposer_m() are PassCostTables measured on this host (pass_costs.py): a dense part by
token count, plus attention over the committed context - each draft token of sequence i is one more query
row over its c_i committed tokens, so a long sequence's drafts cost more than a short one's. The proposer's
j-th pass carries one token per sequence drafting at least j tokens (its first pass also catches the
proposer up on the tokens committed since it last ran). Proposers without a table (n-gram lookup) are free.
A proposer pass is priced as the proposer runs it, its draws included (proposal_timing.py). Once any sequence
speculates, the step also costs the work outside the passes that speculating adds (verification, rollback),
measured by step_overhead.StepOverhead.

The step's goodput is expected tokens per second: (num_sure_tokens + sum of gains) / cost. `choose_lengths`
walks the draft tokens in order of decreasing gain per the least each can cost (the target's smallest slope
from the base pass on, plus its row's attention: a deep sequence's tokens come after a short one's of the same
gain) - each sequence's chain grows one token at a time, the most likely token first - and keeps the prefix of
that walk with the best goodput. The empty prefix is plain
decoding, so zero is chosen whenever speculation does not pay; speculation must beat it by `min_gain`, so
measurement noise does not flip a batch between the two. Token trees (`tree_size`): a sequence whose chain
came out non-empty gets its tree instead when the tree's estimate (below) gives the batch more goodput.
"""

import heapq
from dataclasses import dataclass
from functools import cached_property

from workers.spec.pass_costs import NO_ATTENTION, AttentionWork, PassCostTable, num_pairs

MIN_GAIN = 1.02  # speculation must promise 2 % more goodput than plain decoding (hysteresis, not tuning)


@dataclass(frozen=True)
class Candidate:
    acceptance: float  # alpha: estimated probability the target accepts one draft token
    max_k: int  # most draft tokens it can take this step (k_max, tokens left, context left)
    proposer: str | None  # key of its proposer's cost table; None = free (n-gram lookup)
    num_catch_up_tokens: int = 1  # tokens the proposer's first pass feeds (committed tokens it has not seen)
    tree_size: int = 0  # > 0: it may propose a token tree of this many nodes instead of a chain
    tree_branching: int = 1
    tree_level_acceptance: float | None = None  # measured chance a tree step passes a level; None = from alpha
    num_context_tokens: int = 0  # committed tokens its draft rows attend to (pass_costs.AttentionWork)


@dataclass(frozen=True)
class LengthPlan:
    lengths: list[int]  # [num_candidates] draft tokens (tree: nodes) per candidate; 0 = plain decoding
    is_tree: list[bool]  # [num_candidates]
    goodput_plain: float  # expected tokens per second with no speculation
    goodput: float  # expected tokens per second of the chosen plan
    seconds: float = 0.0  # the chosen plan's predicted step time


class _StepCost:
    """Running cost of a step as draft tokens are added: target pass + each proposer's passes + the measured
    work outside the passes that a speculative step adds (step_overhead.py)."""

    def __init__(self, step: "StepPricing") -> None:
        self.step = step
        self.pass_tokens: dict[str, list[int]] = {name: [] for name in step.proposers}  # proposer -> [depth] tokens
        self.pass_keys: dict[str, list[int]] = {name: [] for name in step.proposers}  # ... their AttentionWork
        self.pass_pairs: dict[str, list[int]] = {name: [] for name in step.proposers}
        self.pass_s: dict[str, list[float]] = {name: [] for name in step.proposers}  # proposer -> [depth] estimate
        self.num_extra_tokens = 0
        self.num_extra_pairs = 0  # the draft rows' attention in the target pass (their sequences' keys are read anyway)
        self.proposer_s = 0.0
        self.overhead_s = 0.0
        self.is_speculative = False

    def start_sequence(self) -> None:
        """One more sequence speculates: the first makes this a speculative step, with its work outside the
        passes; each adds its own share of that work (step_overhead.py)."""
        if not self.is_speculative:
            self.overhead_s, self.is_speculative = self.step.speculative_step_s, True
        self.overhead_s += self.step.speculative_seq_s

    def add(self, proposer: str | None, depth: int, num_tokens: int, num_context_tokens: int = 0) -> None:
        """One more draft token at `depth` (1-based), a row over num_context_tokens in the target pass; its
        proposer's pass at that depth gets num_tokens more (rows of that sequence over the same context)."""
        self.num_extra_tokens += 1
        self.num_extra_pairs += num_context_tokens
        if proposer is None:
            return
        passes, pass_s = self.pass_tokens[proposer], self.pass_s[proposer]
        keys, pairs = self.pass_keys[proposer], self.pass_pairs[proposer]
        while len(passes) < depth:
            passes.append(0)
            keys.append(0)
            pairs.append(0)
            pass_s.append(0.0)
        d = depth - 1
        passes[d] += num_tokens
        if num_tokens:
            keys[d] += num_context_tokens
            pairs[d] += num_pairs(num_tokens, num_context_tokens)
        seconds = self.step.proposers[proposer].estimate_s(passes[d], AttentionWork(keys[d], pairs[d]))
        self.proposer_s += seconds - pass_s[depth - 1]
        pass_s[depth - 1] = seconds

    @property
    def seconds(self) -> float:
        step = self.step
        work = AttentionWork(step.base_work.num_keys, step.base_work.num_pairs + self.num_extra_pairs)
        target_s = step.target.estimate_s(step.num_base_tokens + self.num_extra_tokens, work)
        passes_s = target_s + self.proposer_s
        return passes_s + self.overhead_s + step.plain_step_s - step.prefill_s


@dataclass(frozen=True)
class StepPricing:
    """What every plan of one step is priced against: its sure tokens, its base pass, the measured costs."""

    num_sure_tokens: int
    num_base_tokens: int
    target: PassCostTable
    proposers: dict[str, PassCostTable]
    speculative_step_s: float = 0.0
    plain_step_s: float = 0.0
    num_prefill_tokens: int = 0  # prefill chunks' tokens among num_base_tokens
    speculative_seq_s: float = 0.0
    base_work: AttentionWork = NO_ATTENTION  # the base pass's decode rows over their sequences' context

    @cached_property
    def prefill_s(self) -> float:
        """The prefill chunks' share of the target pass: done whether or not the step drafts, so it is left out
        and drafts are judged against what the decodes alone take, not against a step the prefill made slow."""
        if not self.num_prefill_tokens:
            return 0.0
        return self.target.estimate_s(self.num_base_tokens) - self.target.estimate_s(  # the same attention in both
            self.num_base_tokens - self.num_prefill_tokens
        )

    def cost(self) -> _StepCost:
        return _StepCost(self)

    def goodput(self, candidates: list[Candidate], lengths: list[int], is_tree: list[bool]) -> float:
        num_tokens, seconds = self.tokens_and_seconds(candidates, lengths, is_tree)
        return num_tokens / seconds

    def tokens_and_seconds(
        self, candidates: list[Candidate], lengths: list[int], is_tree: list[bool]
    ) -> tuple[float, float]:
        """(expected tokens, predicted seconds) of the step with these lengths."""
        cost = self.cost()
        num_tokens = float(self.num_sure_tokens)
        for c, k, tree in zip(candidates, lengths, is_tree, strict=True):
            if k:
                cost.start_sequence()
            if tree:
                # pass 1 catches up and scores the first level; pass d feeds level d - 1 to score level d
                levels = tree_shape(c.tree_size, c.tree_branching)
                for depth, width in enumerate(levels, start=1):
                    fed = c.num_catch_up_tokens if depth == 1 else levels[depth - 2]
                    for node in range(width):
                        cost.add(c.proposer, depth, fed if node == 0 else 0, c.num_context_tokens)
                num_tokens += tree_gain(c.acceptance, c.tree_size, c.tree_branching, c.tree_level_acceptance)
            else:
                for depth in range(1, k + 1):
                    cost.add(c.proposer, depth, c.num_catch_up_tokens if depth == 1 else 1, c.num_context_tokens)
                num_tokens += chain_gain(c.acceptance, k)
        return num_tokens, cost.seconds


def chain_gain(acceptance: float, k: int) -> float:
    """Expected accepted draft tokens of a chain of k: alpha + ... + alpha^k."""
    return sum(acceptance**j for j in range(1, k + 1))


def tree_shape(size: int, branching: int) -> list[int]:
    """Nodes per level of a tree grown level by level with `branching` children per node, up to size nodes."""
    levels: list[int] = []
    width = branching
    while sum(levels) < size:
        levels.append(min(width, size - sum(levels)))
        width *= branching
    return levels


def tree_gain(acceptance: float, size: int, branching: int, level_acceptance: float | None = None) -> float:
    """Expected accepted tokens of a tree: each level is passed with level_acceptance where it was measured,
    else with 1 - (1 - alpha)^b (one of up to `branching` siblings must match, each taken as independent)."""
    gain, reach = 0.0, 1.0
    for width in tree_shape(size, branching):
        passed = level_acceptance if level_acceptance is not None else 1.0 - (1.0 - acceptance) ** min(width, branching)
        reach *= passed
        gain += reach
    return gain


def choose_lengths(
    candidates: list[Candidate],
    num_sure_tokens: int,  # tokens the step emits whatever is drafted (one per sampling sequence)
    num_base_tokens: int,  # tokens of the target pass before speculation (prefill chunks + decodes)
    max_extra_tokens: int,  # room left in the pass's token budget for draft tokens
    target: PassCostTable,
    proposers: dict[str, PassCostTable],
    min_gain: float = MIN_GAIN,
    speculative_step_s: float = 0.0,  # measured work outside the passes a speculative step adds (step_overhead.py)
    plain_step_s: float = 0.0,  # measured work outside the passes of any step of this batch (step_overhead.py)
    num_prefill_tokens: int = 0,  # prefill chunks' tokens among num_base_tokens (their pass share is left out)
    speculative_seq_s: float = 0.0,  # measured work outside the passes each speculating sequence adds
    base_work: AttentionWork = NO_ATTENTION,  # attention of the base pass's decode rows (pass_costs.py)
) -> LengthPlan:
    no_plan = LengthPlan([0] * len(candidates), [False] * len(candidates), 0.0, 0.0)
    if not candidates or not target.is_measured:
        return no_plan
    step = StepPricing(
        num_sure_tokens, num_base_tokens, target, proposers, speculative_step_s, plain_step_s, num_prefill_tokens,
        speculative_seq_s, base_work,
    )  # fmt: skip
    cost = step.cost()
    plain_s = cost.seconds
    plain = num_sure_tokens / plain_s
    marginal_s = target.min_slope_s(num_base_tokens)  # each draft token makes the target pass at least this dearer
    least_s = [max(marginal_s + target.attention.s_per_pair * c.num_context_tokens, 1e-12) for c in candidates]
    walk = _Walk(candidates, least_s, max_extra_tokens)
    lengths = [0] * len(candidates)
    best_lengths, best = list(lengths), plain * min_gain
    num_tokens = float(num_sure_tokens)
    while (token := walk.next()) is not None:
        gain, depth, i = token
        c = candidates[i]
        if depth == 1:
            cost.start_sequence()
        cost.add(c.proposer, depth, c.num_catch_up_tokens if depth == 1 else 1, c.num_context_tokens)
        lengths[i] = depth
        num_tokens += gain
        seconds = cost.seconds
        goodput = num_tokens / seconds
        if goodput > best:
            best_lengths, best = list(lengths), goodput
        # a longer prefix adds at most the gains left at no less cost (costs never fall as tokens are added):
        # once even that cannot beat the best, the rest of the walk is skipped - the same plan, sooner
        if (num_tokens + walk.gains_left) / seconds <= best:
            break
        # nor once the next token's gain per the least it can cost is no better: no later token gains more per
        # the least it costs, so a longer prefix's goodput (a mediant) cannot pass best
        if walk.next_ratio() <= best:
            break
    if not any(best_lengths):  # plain decoding wins: no tree can be tried (a tree replaces a chain)
        return LengthPlan(best_lengths, [False] * len(candidates), plain, plain, plain_s)
    is_tree = _upgrade_to_trees(step, candidates, best_lengths, max_extra_tokens)
    chosen = [c.tree_size if tree else k for c, k, tree in zip(candidates, best_lengths, is_tree, strict=True)]
    num_tokens, seconds = step.tokens_and_seconds(candidates, chosen, is_tree)
    return LengthPlan(chosen, is_tree, plain, num_tokens / seconds, seconds)


class _Walk:
    """The draft tokens in order of decreasing gain per the least each can cost (ties: the larger gain, the
    shallower depth, the later candidate), at most `max_tokens` of them, produced as they are walked: a
    heap of each candidate's next depth, so a walk that stops after a few tokens never orders the rest."""

    def __init__(self, candidates: list[Candidate], least_s: list[float], max_tokens: int) -> None:
        self.candidates = candidates
        self.least_s = least_s
        self.num_left = max_tokens
        self.heap: list[tuple[float, float, int, int]] = []  # (-gain / least_s, -gain, depth, -candidate)
        self.gains_left = 0.0  # every gain not walked yet (an upper bound on what the walk can still add)
        for i, c in enumerate(candidates):
            if c.acceptance > 0 and c.max_k > 0:
                self._push(i, 1)
                a = c.acceptance
                self.gains_left += c.max_k if a >= 1.0 else a * (1.0 - a**c.max_k) / (1.0 - a)

    def _push(self, i: int, depth: int) -> None:
        gain = self.candidates[i].acceptance**depth
        heapq.heappush(self.heap, (-gain / self.least_s[i], -gain, depth, -i))

    def next(self) -> tuple[float, int, int] | None:
        """(gain, depth, candidate) of the next draft token, or None when the walk is over."""
        if self.num_left <= 0 or not self.heap:
            return None
        _, neg_gain, depth, neg_i = heapq.heappop(self.heap)
        i = -neg_i
        if depth < self.candidates[i].max_k:
            self._push(i, depth + 1)
        self.num_left -= 1
        self.gains_left -= -neg_gain
        return -neg_gain, depth, i

    def next_ratio(self) -> float:
        """Gain per least cost of the token next() would give (0 when there is none)."""
        return -self.heap[0][0] if self.heap and self.num_left > 0 else 0.0


def _upgrade_to_trees(
    step: StepPricing, candidates: list[Candidate], lengths: list[int], max_extra_tokens: int
) -> list[bool]:
    """Swap a chain for its sequence's tree, one sequence at a time, wherever that raises the goodput."""
    is_tree = [False] * len(candidates)
    if not any(c.tree_size for c in candidates):
        return is_tree
    current = list(lengths)
    best = step.goodput(candidates, current, is_tree)
    for i, c in enumerate(candidates):
        if not c.tree_size or not lengths[i]:
            continue
        if sum(current) - current[i] + c.tree_size > max_extra_tokens:
            continue
        trial_tree = list(is_tree)
        trial_tree[i] = True
        trial = list(current)
        trial[i] = c.tree_size
        goodput = step.goodput(candidates, trial, trial_tree)
        if goodput > best:
            is_tree, current, best = trial_tree, trial, goodput
    return is_tree
