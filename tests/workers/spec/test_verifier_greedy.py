"""Greedy verification with constructed logits whose argmax is the token each test wants."""

import torch

from workers.engine.sampling_params import SamplingParams
from workers.spec.distributions import logits_to_probs
from workers.spec.proposal import Proposal
from workers.spec.tree import TokenTree
from workers.spec.verifier import verify_chain, verify_chains, verify_tree
from workers.spec.verify_batch import VerifyEntry, verify_batch

VOCAB = 10


def target_probs_with_argmax(tokens: list[int]) -> torch.Tensor:  # [len(tokens), V] one-hot
    """Target rows whose argmax is `tokens[i]`, through the greedy (temperature 0) transform."""
    gen = torch.Generator().manual_seed(len(tokens))
    logits = torch.randn(len(tokens), VOCAB, generator=gen)  # [n, V]
    logits[torch.arange(len(tokens)), torch.tensor(tokens)] = 10.0
    n = len(tokens)
    return logits_to_probs(logits, torch.zeros(n), torch.zeros(n, dtype=torch.long), torch.ones(n))


def chain(draft: list[int], target_argmax: list[int]) -> tuple[int, list[int]]:
    result = verify_chain(
        torch.tensor(draft), None, target_probs_with_argmax(target_argmax), None, is_greedy=True
    )
    return result.num_accepted, result.tokens


def test_all_accepted_emits_bonus() -> None:
    assert chain([1, 2, 3], [1, 2, 3, 4]) == (3, [1, 2, 3, 4])


def test_first_rejected_emits_recovered() -> None:
    assert chain([1, 2, 3], [5, 2, 3, 4]) == (0, [5])


def test_middle_rejected_emits_recovered() -> None:
    assert chain([1, 2, 3], [1, 7, 3, 4]) == (1, [1, 7])


def test_no_draft_tokens_is_plain_greedy_decoding() -> None:
    assert chain([], [6]) == (0, [6])


def test_raw_logits_give_the_same_result_as_one_hot_rows() -> None:
    logits = torch.full((4, VOCAB), -1.0)  # [4, V]
    logits[torch.arange(4), torch.tensor([1, 2, 9, 4])] = 3.0
    result = verify_chain(torch.tensor([1, 2, 3]), None, logits, None, is_greedy=True)
    assert (result.num_accepted, result.tokens) == (2, [1, 2, 9])


def test_greedy_ignores_draft_probs_and_generator() -> None:
    draft_probs = torch.full((3, VOCAB), 1.0 / VOCAB)  # [3, V]
    gen = torch.Generator().manual_seed(0)
    state = gen.get_state()
    result = verify_chain(
        torch.tensor([1, 2, 3]), draft_probs, target_probs_with_argmax([1, 2, 0, 4]), gen, True
    )
    assert result.tokens == [1, 2, 0]
    assert torch.equal(gen.get_state(), state)  # greedy draws nothing


def test_batched_greedy_matches_per_sequence() -> None:
    drafts = [[1, 2, 3], [], [4, 4], [7]]
    argmaxes = [[1, 2, 3, 4], [6], [4, 5, 0], [8, 1]]
    results = verify_chains(
        torch.tensor([t for d in drafts for t in d]),
        [len(d) for d in drafts],
        None,
        torch.cat([target_probs_with_argmax(a) for a in argmaxes]),
        [None] * 4,
        [True] * 4,
    )
    assert [(r.num_accepted, r.tokens) for r in results] == [
        chain(d, a) for d, a in zip(drafts, argmaxes, strict=True)
    ]
    assert [r.tokens for r in results] == [[1, 2, 3, 4], [6], [4, 5], [8]]


def sample_tree() -> TokenTree:
    # root -> 3 (node 0) -> 6 (node 2)
    # root -> 5 (node 1) -> 7 (node 3)
    #                    -> 8 (node 4)
    return TokenTree(tokens=torch.tensor([3, 5, 6, 7, 8]), parents=torch.tensor([-1, -1, 0, 1, 1]))


def test_tree_greedy_follows_the_matching_branch() -> None:
    # rows: after root, after node 0..4
    target = target_probs_with_argmax([5, 6, 8, 1, 2, 9])
    result = verify_tree(sample_tree(), None, target, None, is_greedy=True)
    assert result.accepted_nodes == [1, 4]
    assert result.tokens == [5, 8, 9]  # bonus: argmax after node 4


def test_tree_greedy_recovers_where_no_child_matches() -> None:
    target = target_probs_with_argmax([5, 6, 8, 1, 2, 9])
    target[2] = target_probs_with_argmax([0])[0]  # after node 1 (token 5) the target wants 0: neither 7 nor 8
    result = verify_tree(sample_tree(), None, target, None, is_greedy=True)
    assert (result.accepted_nodes, result.tokens) == ([1], [5, 0])


def test_tree_greedy_rejects_at_the_root() -> None:
    result = verify_tree(
        sample_tree(), None, target_probs_with_argmax([4, 6, 8, 1, 2, 9]), None, is_greedy=True
    )
    assert (result.accepted_nodes, result.tokens) == ([], [4])


def test_greedy_tree_on_a_chain_equals_verify_chain() -> None:
    gen = torch.Generator().manual_seed(3)
    for _ in range(50):
        k = int(torch.randint(0, 5, (1,), generator=gen))
        draft = torch.randint(0, 3, (k,), generator=gen)
        target = torch.randn(k + 1, 3, generator=gen)  # [k + 1, 3]: small vocabulary, frequent matches
        by_chain = verify_chain(draft, None, target, None, is_greedy=True)
        by_tree = verify_tree(TokenTree.chain(draft), None, target, None, is_greedy=True)
        assert by_tree.tokens == by_chain.tokens
        assert by_tree.num_accepted == by_chain.num_accepted


def test_an_all_greedy_batch_of_chains_verifies_as_verify_chains_does() -> None:
    """verify_batch reads an all-greedy batch of chains from one list of argmaxes: the same verdicts as
    verify_chains, for plain decodes, fixed (n-gram) and drafted chains, accepted whole, in part or not at all."""
    gen = torch.Generator().manual_seed(11)
    for _ in range(50):
        proposals: list[Proposal | None] = []
        for _ in range(int(torch.randint(1, 6, (1,), generator=gen))):
            k = int(torch.randint(0, 5, (1,), generator=gen))
            tokens = torch.randint(0, 4, (k,), generator=gen).tolist()  # a small vocabulary: many matches
            probs = torch.rand(k, VOCAB, generator=gen) if k and k % 2 else None
            proposals.append(Proposal(tokens, probs) if k else None)
        num_rows = sum(1 + (p.num_tokens if p else 0) for p in proposals)
        logits = torch.randn(num_rows, VOCAB, generator=gen)  # [S, V]
        logits[:, :4] += 2.0  # the argmax mostly among the drafted tokens
        entries = [VerifyEntry(SamplingParams(temperature=0.0), None, p) for p in proposals]
        fast = verify_batch(entries, logits)
        reference = verify_chains(
            torch.tensor([t for p in proposals if p for t in p.tokens], dtype=torch.long),
            [p.num_tokens if p else 0 for p in proposals],
            None,
            logits,
            [None] * len(proposals),
            [True] * len(proposals),
        )
        assert [(v.tokens, v.num_accepted) for v in fast] == [(r.tokens, r.num_accepted) for r in reference]
