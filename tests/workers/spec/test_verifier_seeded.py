"""Seeded determinism: same generator seed, same tokens - whatever the batch, chain or chain-shaped tree."""

import torch

from workers.spec.tree import TokenTree, TreeBuilder
from workers.spec.verifier import ChainResult, verify_chain, verify_chains, verify_tree

VOCAB = 7


def random_case(gen: torch.Generator, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    draft_probs = torch.randn(k, VOCAB, generator=gen).softmax(dim=-1)  # [k, V]
    draft_tokens = (
        torch.stack([torch.multinomial(q, 1, generator=gen)[0] for q in draft_probs])
        if k
        else torch.zeros(0, dtype=torch.long)
    )  # [k]
    target_probs = (torch.randn(k + 1, VOCAB, generator=gen) * 0.5).softmax(dim=-1)  # [k + 1, V]
    return draft_tokens, draft_probs, target_probs


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_same_seed_same_chain_tokens() -> None:
    draft_tokens, draft_probs, target_probs = random_case(seeded(0), k=4)
    runs = [verify_chain(draft_tokens, draft_probs, target_probs, seeded(42), False) for _ in range(3)]
    assert runs[0] == runs[1] == runs[2]
    outcomes = {
        tuple(verify_chain(draft_tokens, draft_probs, target_probs, seeded(s), False).tokens)
        for s in range(40)
    }
    assert len(outcomes) > 1  # the seed matters


def test_seeded_sequence_is_independent_of_batch_company() -> None:
    gen = seeded(1)
    cases = [random_case(gen, k) for k in (3, 0, 5, 2, 4)]
    seeds: list[int | None] = [11, None, 12, None, 13]
    is_greedy = [False, False, False, True, False]
    alone = [
        verify_chain(*case, seeded(s), False) for case, s in zip(cases, seeds, strict=True) if s is not None
    ]

    def run_batch(order: list[int]) -> list[ChainResult]:
        results = verify_chains(
            torch.cat([cases[i][0] for i in order]),
            [cases[i][0].shape[0] for i in order],
            torch.cat([cases[i][1] for i in order]),
            torch.cat([cases[i][2] for i in order]),
            [None if seeds[i] is None else seeded(seeds[i]) for i in order],  # type: ignore[arg-type]
            [is_greedy[i] for i in order],
        )
        by_case = dict(zip(order, results, strict=True))
        return [by_case[i] for i in (0, 2, 4)]

    assert run_batch([0, 1, 2, 3, 4]) == alone
    assert run_batch([4, 2, 0]) == alone
    assert run_batch([3, 2, 1, 0, 4]) == alone


def test_sampling_tree_on_a_chain_equals_verify_chain() -> None:
    gen = seeded(2)
    for trial in range(100):
        k = trial % 5
        draft_tokens, draft_probs, target_probs = random_case(gen, k)
        tree_draft_probs = torch.cat(
            [draft_probs, torch.zeros(1, VOCAB)]
        )  # [k + 1, V]: the leaf row is unused
        for chain_q, tree_q in ((draft_probs, tree_draft_probs), (None, None)):
            by_chain = verify_chain(draft_tokens, chain_q, target_probs, seeded(trial), False)
            by_tree = verify_tree(TokenTree.chain(draft_tokens), tree_q, target_probs, seeded(trial), False)
            assert (by_tree.num_accepted, by_tree.tokens) == (by_chain.num_accepted, by_chain.tokens)


def test_same_seed_same_tree_and_tree_tokens() -> None:
    q = torch.randn(VOCAB, generator=seeded(3)).softmax(dim=-1)  # [V] one draft row reused at every node
    p = torch.randn(VOCAB, generator=seeded(4)).softmax(dim=-1)  # [V]

    def build_and_verify(seed: int) -> tuple[list[int], list[int], list[int]]:
        gen = seeded(seed)
        builder = TreeBuilder(tree_size=8, branching=3, is_greedy=False, generator=gen)
        while not builder.is_done:
            builder.expand(q.expand(len(builder.frontier), VOCAB))
        tree, draft_probs = builder.build()
        result = verify_tree(tree, draft_probs, p.expand(tree.num_nodes + 1, VOCAB), gen, is_greedy=False)
        return tree.tokens.tolist(), result.accepted_nodes, result.tokens

    assert build_and_verify(5) == build_and_verify(5)
    assert len({str(build_and_verify(s)) for s in range(10)}) > 1


def test_acceptance_rule_extremes() -> None:
    p = torch.tensor([0.0, 0.5, 0.5, 0.0, 0.0, 0.0, 0.0])  # [V]
    q = torch.tensor([0.5, 0.25, 0.25, 0.0, 0.0, 0.0, 0.0])  # [V]
    for seed in range(50):
        # p(x) = 0: never accepted; the recovered token comes from max(0, p - q) = {1, 2}
        result = verify_chain(torch.tensor([0]), q.unsqueeze(0), torch.stack([p, p]), seeded(seed), False)
        assert result.num_accepted == 0 and result.tokens[0] in (1, 2)
        # p(x) >= q(x): always accepted, and the bonus token comes from p
        result = verify_chain(
            torch.tensor([1, 2]), torch.stack([q, q]), torch.stack([p, p, p]), seeded(seed), False
        )
        assert result.num_accepted == 2 and result.tokens[2] in (1, 2)


def test_one_hot_draft_rows_equal_no_draft_probs() -> None:
    gen = seeded(6)
    cases = [random_case(gen, k) for k in (4, 2, 3)]
    draft_tokens = torch.cat([c[0] for c in cases])  # [T]
    target_probs = torch.cat([c[2] for c in cases])  # [T + B, V]
    one_hot = torch.nn.functional.one_hot(draft_tokens, VOCAB).float()  # [T, V]
    runs = [
        verify_chains(
            draft_tokens, [4, 2, 3], q, target_probs, [seeded(7), seeded(8), seeded(9)], [False] * 3
        )
        for q in (None, one_hot)
    ]
    assert runs[0] == runs[1]
