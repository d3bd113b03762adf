"""The length policy: per-step speculation lengths from acceptance and measured pass costs."""

import pytest

from workers.spec.length_policy import Candidate, chain_gain, choose_lengths, tree_gain, tree_shape
from workers.spec.pass_costs import NO_ATTENTION, AttentionCost, AttentionWork, PassCostTable


def table(cost_s, max_tokens: int = 512) -> PassCostTable:
    t = PassCostTable(max_tokens=max_tokens)
    for n in t.grid:
        t.observe(n, cost_s(n))
    return t


MEMORY_BOUND = table(lambda n: 10e-3 + 0.1e-3 * n)  # a pass costs about the same for 1 or 30 tokens
COMPUTE_BOUND = table(lambda n: 1e-3 * n)  # every token costs the same
CHEAP_DRAFT = {"draft": table(lambda n: 0.5e-3 + 0.01e-3 * n)}  # 1/20 of a target pass
DEAR_DRAFT = {"draft": table(lambda n: 10e-3 + 0.1e-3 * n)}  # as dear as the target


def candidates(n: int, acceptance: float, proposer: str | None = "draft", max_k: int = 8) -> list[Candidate]:
    return [Candidate(acceptance=acceptance, max_k=max_k, proposer=proposer) for _ in range(n)]


def test_a_cheap_draft_with_good_acceptance_speculates_deep_at_batch_1() -> None:
    plan = choose_lengths(candidates(1, 0.8), 1, 1, 512, MEMORY_BOUND, CHEAP_DRAFT)
    assert plan.lengths[0] >= 5 and plan.goodput > 2 * plan.goodput_plain


def test_length_grows_with_acceptance() -> None:
    ks = [choose_lengths(candidates(1, a / 10), 1, 1, 512, MEMORY_BOUND, CHEAP_DRAFT).lengths[0] for a in range(10)]
    assert ks == sorted(ks) and ks[0] == 0 and ks[-1] > 3


def test_zero_where_it_does_not_pay() -> None:
    dear = choose_lengths(candidates(1, 0.5), 1, 1, 512, MEMORY_BOUND, DEAR_DRAFT)  # draft costs a target pass
    assert dear.lengths == [0] and dear.goodput == dear.goodput_plain
    compute_bound = choose_lengths(candidates(16, 0.5), 16, 16, 512, COMPUTE_BOUND, CHEAP_DRAFT)
    assert compute_bound.lengths == [0] * 16


def test_a_large_batch_speculates_less_than_one_sequence() -> None:
    solo = choose_lengths(candidates(1, 0.7), 1, 1, 512, table(lambda n: 10e-3 + 0.5e-3 * n), CHEAP_DRAFT)
    batch = choose_lengths(candidates(32, 0.7), 32, 32, 512, table(lambda n: 10e-3 + 0.5e-3 * n), CHEAP_DRAFT)
    assert 0 < sum(batch.lengths) / 32 < solo.lengths[0]


def test_free_proposals_fill_what_the_memory_bound_pass_gives_for_free() -> None:
    plan = choose_lengths(candidates(1, 0.8, proposer=None, max_k=6), 1, 1, 512, MEMORY_BOUND, {})
    assert plan.lengths == [6]


def test_better_sequences_get_longer_chains_in_a_mixed_batch() -> None:
    mixed = [Candidate(0.9, 8, "draft"), Candidate(0.3, 8, "draft"), Candidate(0.05, 8, "draft")]
    lengths = choose_lengths(mixed, 3, 3, 512, table(lambda n: 10e-3 + 0.3e-3 * n), CHEAP_DRAFT).lengths
    assert lengths[0] > lengths[1] >= lengths[2] and lengths[2] == 0


def test_the_budget_and_each_sequences_limit_hold() -> None:
    plan = choose_lengths(candidates(4, 0.95, max_k=3), 4, 4, 5, MEMORY_BOUND, CHEAP_DRAFT)
    assert sum(plan.lengths) <= 5 and max(plan.lengths) <= 3
    assert choose_lengths(candidates(2, 0.9), 2, 2, 0, MEMORY_BOUND, CHEAP_DRAFT).lengths == [0, 0]


def test_an_unmeasured_target_means_plain_decoding() -> None:
    assert choose_lengths(candidates(2, 0.9), 2, 2, 64, PassCostTable(), CHEAP_DRAFT).lengths == [0, 0]


def test_the_chosen_plan_is_never_expected_slower_than_plain() -> None:
    for target in (MEMORY_BOUND, COMPUTE_BOUND):
        for drafts in (CHEAP_DRAFT, DEAR_DRAFT):
            for n in (1, 4, 16, 32):
                for acceptance in (0.0, 0.3, 0.6, 0.9):
                    plan = choose_lengths(candidates(n, acceptance), n, n, 512, target, drafts)
                    assert plan.goodput >= plan.goodput_plain


def test_a_tree_replaces_a_chain_when_it_promises_more() -> None:
    tree_candidate = [Candidate(0.5, 5, "draft", tree_size=6, tree_branching=2)]
    plan = choose_lengths(tree_candidate, 1, 1, 512, MEMORY_BOUND, CHEAP_DRAFT)
    assert plan.is_tree == [True] and plan.lengths == [6]
    dear = choose_lengths(tree_candidate, 1, 1, 512, COMPUTE_BOUND, CHEAP_DRAFT)  # extra target tokens are dear
    assert dear.is_tree == [False]


def test_gains() -> None:
    assert chain_gain(0.5, 3) == pytest.approx(0.5 + 0.25 + 0.125)
    assert tree_shape(6, 2) == [2, 4] and tree_shape(5, 2) == [2, 3] and tree_shape(3, 1) == [1, 1, 1]
    assert tree_gain(0.5, 3, 1) == pytest.approx(chain_gain(0.5, 3))  # branching 1 is a chain
    assert tree_gain(0.5, 6, 2) > chain_gain(0.5, 2)  # two tries per level beat one


def test_a_measured_tree_level_rate_decides_over_the_estimate_from_alpha() -> None:
    hopeful = Candidate(0.5, 5, "draft", tree_size=6, tree_branching=2)  # 1 - 0.5^2 = 0.75 a level, from alpha
    measured = Candidate(0.5, 5, "draft", tree_size=6, tree_branching=2, tree_level_acceptance=0.2)
    assert choose_lengths([hopeful], 1, 1, 512, MEMORY_BOUND, CHEAP_DRAFT).is_tree == [True]
    assert choose_lengths([measured], 1, 1, 512, MEMORY_BOUND, CHEAP_DRAFT).is_tree == [False]
    assert tree_gain(0.5, 6, 2, level_acceptance=0.2) == pytest.approx(0.2 + 0.04)


def test_the_work_speculation_adds_outside_the_passes_counts() -> None:
    """A batch whose passes alone would pay for drafting stays plain once the measured work a speculative step
    adds (verification, proposals) eats the gain; one sequence with a long, likely chain still drafts."""
    passes = table(lambda n: 8e-3 + 0.1e-3 * n)
    free_of_overhead = choose_lengths(candidates(16, 0.5), 16, 16, 512, passes, CHEAP_DRAFT)
    assert sum(free_of_overhead.lengths) > 0
    dear = choose_lengths(candidates(16, 0.5), 16, 16, 512, passes, CHEAP_DRAFT, speculative_step_s=6e-3)
    assert dear.lengths == [0] * 16 and dear.goodput == dear.goodput_plain
    solo = choose_lengths(candidates(1, 0.9), 1, 1, 512, passes, CHEAP_DRAFT, speculative_step_s=6e-3)
    assert solo.lengths[0] >= 4
    charged_once = choose_lengths(candidates(4, 0.9), 4, 4, 512, passes, CHEAP_DRAFT, speculative_step_s=1e-3)
    assert all(k >= 3 for k in charged_once.lengths)  # a step's charge, not one per speculating sequence


@pytest.mark.parametrize("seed", range(16))
def test_the_walk_stops_early_only_where_no_longer_prefix_can_win(seed: int) -> None:
    """The plan equals the best prefix of the whole walk (every prefix scored, in the walk's order), whatever
    the early exits skip: memory-bound targets to compute-bound ones (up to 0.6 ms a token), batches of 4 to 32,
    with and without attention over contexts of up to 3,000 tokens."""
    import random

    from workers.spec.length_policy import StepPricing

    rng = random.Random(seed)
    batch = rng.choice([4, 16, 32])
    with_attention = seed % 2 == 1
    cands = [
        Candidate(rng.uniform(0.05, 0.95), 8, "draft", num_context_tokens=rng.randrange(3000) if with_attention else 0)
        for _ in range(batch)
    ]
    slope_ms = rng.uniform(0.01, 0.6)
    passes = table(lambda n: 8e-3 + slope_ms * 1e-3 * n * rng.uniform(0.9, 1.1))  # with a little noise
    if with_attention:
        passes.attention = AttentionCost(s_per_key=rng.uniform(0, 0.5e-6), s_per_pair=rng.uniform(0, 0.5e-6))
    base = AttentionWork(sum(c.num_context_tokens for c in cands), sum(c.num_context_tokens for c in cands))
    plan = choose_lengths(cands, batch, batch, 512, passes, CHEAP_DRAFT, speculative_step_s=1e-3, base_work=base)

    least_s = [max(passes.min_slope_s(batch) + passes.attention.s_per_pair * c.num_context_tokens, 1e-12) for c in cands]
    walk = sorted(
        ((c.acceptance**j / least_s[i], c.acceptance**j, -j, i) for i, c in enumerate(cands) for j in range(1, 9)),
        reverse=True,
    )
    lengths, best_lengths = [0] * batch, [0] * batch
    best = plan.goodput_plain * 1.02
    pricing = StepPricing(batch, batch, passes, CHEAP_DRAFT, 1e-3, base_work=base)
    for _, _, neg_depth, i in walk:
        lengths[i] = -neg_depth
        goodput = pricing.goodput(cands, lengths, [False] * batch)
        if goodput > best:
            best_lengths, best = list(lengths), goodput
    assert plan.lengths == best_lengths


class CountingTable(PassCostTable):
    num_estimates = 0

    def estimate_s(self, num_tokens: int, work: AttentionWork = NO_ATTENTION) -> float:
        CountingTable.num_estimates += 1
        return super().estimate_s(num_tokens, work)


def test_a_batch_where_no_draft_token_can_pay_is_walked_a_token_or_two() -> None:
    """32 sequences at acceptance 0.5 on a target whose every token costs 0.4 ms: the first draft token already
    gains less per the least it costs than plain decoding delivers, so the walk ends there instead of scoring
    dozens of prefixes that cannot win."""
    target = CountingTable(max_tokens=512)
    for n in target.grid:
        target.observe(n, 4e-3 + 0.4e-3 * n)
    CountingTable.num_estimates = 0
    plan = choose_lengths(candidates(32, 0.5), 32, 32, 512, target, CHEAP_DRAFT)
    assert plan.lengths == [0] * 32
    assert CountingTable.num_estimates <= 4  # plain, then a prefix or two


def test_the_rest_of_a_step_is_priced_into_both_sides() -> None:
    """A step's rest (outside its passes) is paid with or without drafts, so drafting's extra cost weighs less
    against it; the plan's predicted time includes it."""
    cands = candidates(16, 0.35)
    base = choose_lengths(cands, 16, 16, 512, MEMORY_BOUND, CHEAP_DRAFT)
    assert any(base.lengths) and base.seconds > 0
    with_rest = choose_lengths(cands, 16, 16, 512, MEMORY_BOUND, CHEAP_DRAFT, plain_step_s=5e-3)
    assert with_rest.goodput / with_rest.goodput_plain > base.goodput / base.goodput_plain
    assert with_rest.seconds == pytest.approx(base.seconds + 5e-3)
    plain = choose_lengths(candidates(16, 0.05), 16, 16, 512, MEMORY_BOUND, CHEAP_DRAFT, plain_step_s=5e-3)
    assert plain.lengths == [0] * 16 and plain.seconds == pytest.approx(16 / plain.goodput_plain)


def test_a_prefill_in_the_step_does_not_make_drafts_look_cheap() -> None:
    """A prefill chunk's share of the pass is done either way: drafts are judged against the decodes alone."""
    cands = candidates(16, 0.3)
    alone = choose_lengths(cands, 16, 16, 1024, MEMORY_BOUND, CHEAP_DRAFT)
    with_prefill = choose_lengths(cands, 16, 16 + 300, 1024, MEMORY_BOUND, CHEAP_DRAFT, num_prefill_tokens=300)
    assert with_prefill.lengths == alone.lengths
    assert with_prefill.goodput_plain == pytest.approx(alone.goodput_plain)
    counted = choose_lengths(cands, 16, 16 + 300, 1024, MEMORY_BOUND, CHEAP_DRAFT)  # as if the prefill were decodes'
    assert counted.goodput_plain < alone.goodput_plain and sum(counted.lengths) > sum(alone.lengths)


def test_a_long_sequences_drafts_cost_more_than_a_short_ones() -> None:
    """Each draft token is a query row over its sequence's committed context (pass_costs.AttentionWork): on a
    target whose rows cost 0.2 us per committed key, a sequence 20,000 tokens deep pays 4 ms a draft token and
    one 10 tokens deep almost nothing, so at the same acceptance the short one drafts and the long one not."""
    target = table(lambda n: 10e-3 + 0.1e-3 * n)
    target.attention = AttentionCost(s_per_key=0.3e-6, s_per_pair=0.2e-6)
    short, deep = (Candidate(0.7, 8, "draft", num_context_tokens=c) for c in (10, 20_000))
    base = AttentionWork.of_rows(1, 10) + AttentionWork.of_rows(1, 20_000)
    plan = choose_lengths([short, deep], 2, 2, 512, target, CHEAP_DRAFT, base_work=base)
    assert plan.lengths[0] >= 3 and plan.lengths[1] == 0
    blind = choose_lengths([short, deep], 2, 2, 512, table(lambda n: 10e-3 + 0.1e-3 * n), CHEAP_DRAFT)
    assert blind.lengths[1] == blind.lengths[0] > 0  # a table without attention cannot tell them apart
