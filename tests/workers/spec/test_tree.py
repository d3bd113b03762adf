"""TokenTree structure helpers and the level-by-level TreeBuilder."""

import pytest
import torch

from workers.spec.tree import ROOT, TokenTree, TreeBuilder

VOCAB = 8


def sample_tree() -> TokenTree:
    # root -> 3 (node 0) -> 6 (node 2)
    # root -> 5 (node 1) -> 7 (node 3) -> 2 (node 5)
    #                    -> 8 (node 4)
    return TokenTree(tokens=torch.tensor([3, 5, 6, 7, 8, 2]), parents=torch.tensor([-1, -1, 0, 1, 1, 3]))


def test_depth_positions_children_and_paths() -> None:
    tree = sample_tree()
    assert tree.depth.tolist() == [0, 0, 1, 1, 1, 2]
    assert tree.positions(offset=10).tolist() == [10, 10, 11, 11, 11, 12]
    assert tree.children(ROOT) == [0, 1]
    assert tree.children(1) == [3, 4]
    assert tree.children(5) == []
    assert tree.path(5) == [1, 3, 5]
    assert tree.path(ROOT) == []


def test_attention_mask_is_self_or_ancestor() -> None:
    mask = sample_tree().attention_mask()
    expected = torch.zeros(6, 6, dtype=torch.bool)  # [n, n]
    for node, ancestors in {0: [0], 1: [1], 2: [0, 2], 3: [1, 3], 4: [1, 4], 5: [1, 3, 5]}.items():
        expected[node, ancestors] = True
    assert torch.equal(mask, expected)


def test_chain_is_a_tree_with_branching_one() -> None:
    tree = TokenTree.chain(torch.tensor([4, 4, 1]))
    assert tree.parents.tolist() == [-1, 0, 1]
    assert torch.equal(tree.attention_mask(), torch.ones(3, 3, dtype=torch.bool).tril())


def test_rejects_parents_out_of_order() -> None:
    with pytest.raises(ValueError):
        TokenTree(tokens=torch.tensor([1, 2]), parents=torch.tensor([1, -1]))
    with pytest.raises(ValueError):
        TokenTree(tokens=torch.tensor([1, 2]), parents=torch.tensor([-1]))


def probs_row(ranking: list[int], masses: list[float]) -> torch.Tensor:  # [V], ranking[i] gets masses[i]
    row = torch.zeros(VOCAB)
    row[torch.tensor(ranking)] = torch.tensor(masses)
    return row


def test_greedy_builder_keeps_the_most_probable_paths() -> None:
    builder = TreeBuilder(tree_size=5, branching=2, is_greedy=True)
    assert builder.frontier == [ROOT]
    new = builder.expand(probs_row([3, 5, 1], [0.6, 0.3, 0.1]).unsqueeze(0))  # [1, V]
    assert new == [0, 1] and [builder.token(n) for n in new] == [3, 5]
    # paths: 3->6 0.6*0.9, 3->7 0.6*0.1, 5->2 0.3*0.5, 5->4 0.3*0.5: budget 3 keeps 3->6, 5->2, 5->4
    rows = torch.stack([probs_row([6, 7], [0.9, 0.1]), probs_row([2, 4], [0.5, 0.5])])  # [2, V]
    assert builder.expand(rows) == [2, 3, 4]
    assert builder.is_done
    tree, draft_probs = builder.build()
    assert tree.tokens.tolist() == [3, 5, 6, 2, 4]
    assert tree.parents.tolist() == [-1, -1, 0, 1, 1]
    assert draft_probs is None  # deterministic proposals


def test_greedy_builder_skips_impossible_tokens_and_respects_max_width() -> None:
    builder = TreeBuilder(tree_size=10, branching=3, is_greedy=True, max_width=2)
    assert builder.expand(probs_row([3], [1.0]).unsqueeze(0)) == [0]  # one-hot q offers one token
    assert builder.expand(probs_row([1, 2, 4], [0.5, 0.3, 0.2]).unsqueeze(0)) == [1, 2]  # width 2
    assert builder.num_nodes == 3 and not builder.is_done


def test_sampling_builder_draws_distinct_children_within_budget() -> None:
    q = torch.randn(VOCAB, generator=torch.Generator().manual_seed(0)).softmax(dim=-1)  # [V]
    builder = TreeBuilder(
        tree_size=7, branching=3, is_greedy=False, generator=torch.Generator().manual_seed(1)
    )
    while not builder.is_done:
        builder.expand(q.expand(len(builder.frontier), VOCAB))
    tree, draft_probs = builder.build()
    assert tree.num_nodes == 7
    assert draft_probs is not None and draft_probs.shape == (8, VOCAB)
    for node in [ROOT, *range(tree.num_nodes)]:
        children = tree.children(node)
        assert len(children) <= 3
        assert len({int(tree.tokens[c]) for c in children}) == len(children)  # without replacement
        row = draft_probs[node + 1]
        assert torch.equal(row, q) if children else not row.any()
    assert len(tree.children(ROOT)) == 3
    # grandchildren: the most probable child is served first with 3, the next gets the last 1
    assert sorted(len(tree.children(c)) for c in tree.children(ROOT)) == [0, 1, 3]


def test_sampling_builder_draws_in_proportion_to_q() -> None:
    q = torch.tensor([0.5, 0.3, 0.2, 0.0, 0.0, 0.0, 0.0, 0.0])  # [V]
    gen = torch.Generator().manual_seed(2)
    firsts, seconds = [], []
    for _ in range(2000):
        builder = TreeBuilder(tree_size=2, branching=2, is_greedy=False, generator=gen)
        builder.expand(q.unsqueeze(0))
        tree, _ = builder.build()
        firsts.append(int(tree.tokens[0]))
        seconds.append(int(tree.tokens[1]))
    first = torch.bincount(torch.tensor(firsts), minlength=VOCAB).float() / 2000  # [V]
    assert torch.allclose(first[:3], q[:3], atol=0.04) and not first[3:].any()
    # second draw given the first was token 0: q without 0, renormalised = [0, 0.6, 0.4]
    after_zero = [s for f, s in zip(firsts, seconds, strict=True) if f == 0]
    share_one = after_zero.count(1) / len(after_zero)
    assert abs(share_one - 0.6) < 0.06


def test_builder_rejects_wrong_number_of_rows() -> None:
    builder = TreeBuilder(tree_size=4, branching=2, is_greedy=True)
    with pytest.raises(ValueError):
        builder.expand(torch.ones(2, VOCAB) / VOCAB)


def test_a_tree_path_accepted_to_a_leaf_rejected_nothing() -> None:
    """Rejections are counted where verification cut a path: a path that ends at a leaf was accepted whole, even
    when another branch of the tree went deeper; one that ends at a node with children had its next token refused."""
    from workers.spec.proposal import Proposal, Verdict

    #   ROOT -> 0 -> 2 -> 3      (the deeper branch)
    #   ROOT -> 1                (a leaf at depth 0)
    tree = TokenTree(tokens=torch.tensor([5, 6, 7, 8]), parents=torch.tensor([ROOT, ROOT, 0, 2]))
    proposal = Proposal(tokens=[5, 6, 7, 8], draft_probs=None, tree=tree)
    assert proposal.depth == 3
    assert not Verdict(tokens=[6, 9], num_accepted=1, accepted_nodes=[1]).rejected_a_draft(proposal)
    assert not Verdict(tokens=[5, 7, 8, 9], num_accepted=3, accepted_nodes=[0, 2, 3]).rejected_a_draft(proposal)
    assert Verdict(tokens=[5, 9], num_accepted=1, accepted_nodes=[0]).rejected_a_draft(proposal)  # node 2 refused
    assert Verdict(tokens=[9], num_accepted=0, accepted_nodes=[]).rejected_a_draft(proposal)  # both roots' children
    chain = Proposal(tokens=[5, 6], draft_probs=None)
    assert Verdict(tokens=[5, 9], num_accepted=1).rejected_a_draft(chain)
    assert not Verdict(tokens=[5, 6, 9], num_accepted=2).rejected_a_draft(chain)
