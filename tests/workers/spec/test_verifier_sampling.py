"""Sampling verification keeps the target's distribution: chi-square tests on a tiny vocabulary.

A toy Markov pair (target p, draft q; each row depends on the previous token) is decoded speculatively
from a fixed start token, and the first emitted token and the first two emitted tokens are compared with
the target's own distribution. Seeds are fixed, so each test is deterministic. The threshold is
conservative: ~14 p-values at 1e-4 each give a correct sampler < 0.2% chance of a false alarm, while the
bugs this guards against (recovered token drawn from p instead of the residual, siblings verified without
removing earlier draws from q, residual not renormalised) score p-values below 1e-60 at these sample
sizes; the negative control below shows the same on the draft's distribution.
"""

import pytest
import torch

from tests.workers.spec.helpers import MarkovModel, chi_square_p_value, make_pair
from workers.spec.tree import ROOT, TreeBuilder
from workers.spec.verifier import verify_chains, verify_tree

START = 0
MIN_P_VALUE = 1e-4
PROCESSED = {"temperature": 0.8, "top_k": 4, "top_p": 0.9}  # top-k and top-p zero some tokens out
MIN_P = {"temperature": 1.2, "min_p": 0.2}  # min-p zeroes the tokens below a fifth of the likeliest
TRANSFORMS = pytest.mark.parametrize(
    "transform", [{}, PROCESSED, MIN_P], ids=["plain", "temperature-top_k-top_p", "temperature-min_p"]
)


def simulate_chains(
    target: MarkovModel, draft: MarkovModel, k: int, n: int, is_one_hot: bool
) -> torch.Tensor:
    """First two tokens emitted by n sequences decoded with chains of k; [n, 2] long."""
    emitted: list[list[int]] = [[] for _ in range(n)]
    last = [START] * n
    while True:
        active = [i for i in range(n) if len(emitted[i]) < 2]
        if not active:
            return torch.tensor(emitted)
        prev = torch.tensor([last[i] for i in active])  # [m]
        draft_tokens, draft_rows, target_rows = [], [], [target.rows[prev]]
        for _ in range(k):
            q = draft.rows[prev]  # [m, V]
            # one-hot proposals (n-gram-like): the draft's most likely token, deterministically
            prev = q.argmax(dim=-1) if is_one_hot else torch.multinomial(q, 1).squeeze(1)  # [m]
            draft_tokens.append(prev)
            draft_rows.append(q)
            target_rows.append(target.rows[prev])
        m, vocab = len(active), target.vocab
        results = verify_chains(
            torch.stack(draft_tokens, dim=1).reshape(m * k),  # [m * k]
            [k] * m,
            None if is_one_hot else torch.stack(draft_rows, dim=1).reshape(m * k, vocab),  # [m * k, V]
            torch.stack(target_rows, dim=1).reshape(m * (k + 1), vocab),  # [m * (k + 1), V]
            [None] * m,
            [False] * m,
        )
        for i, result in zip(active, results, strict=True):
            emitted[i] = (emitted[i] + result.tokens)[:2]
            last[i] = emitted[i][-1]


def simulate_trees(
    target: MarkovModel, draft: MarkovModel, n: int, tree_size: int, branching: int, is_greedy_tree: bool
) -> torch.Tensor:
    """First two tokens emitted by n sequences decoded with token trees, sampling verification; [n, 2]."""
    gen = torch.Generator().manual_seed(1234)
    samples = []
    for _ in range(n):
        emitted: list[int] = []
        last = START
        while len(emitted) < 2:
            builder = TreeBuilder(tree_size, branching, is_greedy=is_greedy_tree, generator=gen)
            while not builder.is_done:
                frontier_tokens = [last if node == ROOT else builder.token(node) for node in builder.frontier]
                builder.expand(draft.rows[frontier_tokens])  # [f, V]
            tree, draft_probs = builder.build()
            target_rows = target.rows[[last] + tree.tokens.tolist()]  # [n + 1, V]
            emitted += verify_tree(tree, draft_probs, target_rows, gen, is_greedy=False).tokens
            last = emitted[-1]
        samples.append(emitted[:2])
    return torch.tensor(samples)


def assert_target_distribution(samples: torch.Tensor, target: MarkovModel) -> None:  # samples: [n, 2]
    vocab = target.vocab
    first_counts = torch.bincount(samples[:, 0], minlength=vocab)  # [V]
    pair_counts = torch.bincount(samples[:, 0] * vocab + samples[:, 1], minlength=vocab * vocab)  # [V * V]
    assert chi_square_p_value(first_counts, target.rows[START]) > MIN_P_VALUE
    assert chi_square_p_value(pair_counts, target.pair_probs(START)) > MIN_P_VALUE


@TRANSFORMS
def test_chain_rejection_sampling_keeps_target_distribution(transform: dict[str, float]) -> None:
    torch.manual_seed(0)
    target, draft = make_pair(vocab=6, seed=1, **transform)  # type: ignore[arg-type]
    assert_target_distribution(simulate_chains(target, draft, k=3, n=30_000, is_one_hot=False), target)


@TRANSFORMS
def test_chain_with_one_hot_proposals_keeps_target_distribution(transform: dict[str, float]) -> None:
    torch.manual_seed(1)
    target, draft = make_pair(vocab=6, seed=2, **transform)  # type: ignore[arg-type]
    assert_target_distribution(simulate_chains(target, draft, k=3, n=30_000, is_one_hot=True), target)


def test_the_chi_square_check_rejects_the_draft_distribution() -> None:
    """Negative control: unverified draft samples fail, so the tests above have power."""
    torch.manual_seed(2)
    target, draft = make_pair(vocab=6, seed=1)
    first = torch.multinomial(draft.rows[START], 40_000, replacement=True)  # [n]
    assert chi_square_p_value(torch.bincount(first, minlength=6), target.rows[START]) < 1e-6


@TRANSFORMS
def test_tree_recursive_rejection_sampling_keeps_target_distribution(transform: dict[str, float]) -> None:
    # budget 7, branching 3: three root children, then 3 + 1 grandchildren (a node served only partly)
    target, draft = make_pair(vocab=5, seed=3, **transform)  # type: ignore[arg-type]
    samples = simulate_trees(target, draft, n=2_000, tree_size=7, branching=3, is_greedy_tree=False)
    assert_target_distribution(samples, target)


def test_tree_of_deterministic_proposals_keeps_target_distribution() -> None:
    # top-k tree (greedy builder) verified by sampling with one-hot q per child (draft_probs None)
    target, draft = make_pair(vocab=5, seed=4)
    samples = simulate_trees(target, draft, n=2_000, tree_size=6, branching=2, is_greedy_tree=True)
    assert_target_distribution(samples, target)
