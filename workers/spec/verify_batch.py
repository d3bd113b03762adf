"""Verification of a whole step's batch from the target's logits: chains in one batched call, trees each.

Rows: every entry (a sequence that samples this step) owns 1 + proposal.num_tokens consecutive logits rows
(just 1 without a proposal: plain decoding is a chain of k = 0). Sampling rows become the target's
distribution p through the request's temperature/top-k/top-p; greedy rows stay logits (argmax only).
A pure function of its inputs: the engine applies the verdicts it returns.
"""

from typing import NamedTuple

import torch

from workers.spec.distributions import GreedyRows, RowSampling, row_distributions
from workers.spec.proposal import Proposal, Verdict
from workers.spec.row_max import RowMax, torch_row_max
from workers.spec.verifier import verify_chains, verify_tree


class VerifyEntry(NamedTuple):
    """One sequence that samples this step, as verification sees it."""

    params: RowSampling  # its request's temperature / top-k / top-p
    generator: torch.Generator | None  # its own RNG (seeded requests); None = the global one
    proposal: Proposal | None  # draft tokens to verify; None = plain decoding (a chain of k = 0)


def verify_batch(
    entries: list[VerifyEntry],  # [B] sequences that sample this step, in row order
    logits: torch.Tensor,  # [S, V] target logits: 1 + proposal.num_tokens rows per entry, entries in order
    row_max: RowMax = torch_row_max,  # each row's max and argmax (the engine's is native where it can be)
) -> list[Verdict]:  # [B] one per entry
    if reads_argmax_only(entries):
        return _verify_greedy_chains([prop for *_, prop in entries], row_max(logits)[1])
    vocab = logits.shape[1]
    row_params = [params for params, _, prop in entries for _ in range(1 + (prop.num_tokens if prop else 0))]
    target = row_distributions(logits, row_params, GreedyRows.LOGITS)  # [S, V]: p on sampling rows
    starts, row = [], 0
    for *_, prop in entries:
        starts.append(row)
        row += 1 + (prop.num_tokens if prop else 0)

    verdicts: list[Verdict | None] = [None] * len(entries)
    chains = [i for i, (*_, prop) in enumerate(entries) if prop is None or prop.tree is None]
    if chains:
        draft_tokens: list[int] = []
        num_draft: list[int] = []
        chain_rows: list[int] = []
        q_rows: list[torch.Tensor] = []
        needs_q = any((prop := entries[i].proposal) is not None and prop.draft_probs is not None for i in chains)
        for i in chains:
            prop = entries[i].proposal
            tokens = prop.tokens if prop else []
            draft_tokens.extend(tokens)
            num_draft.append(len(tokens))
            chain_rows.extend(range(starts[i], starts[i] + len(tokens) + 1))
            if needs_q and tokens:
                if prop is not None and prop.draft_probs is not None:
                    q_rows.append(prop.draft_probs)
                else:  # fixed proposals (n-gram, greedy draft): q one-hot at the token
                    q_rows.append(torch.nn.functional.one_hot(torch.tensor(tokens), vocab).float())
        results = verify_chains(
            torch.tensor(draft_tokens, dtype=torch.long),
            num_draft,
            torch.cat(q_rows) if q_rows else None,
            target.index_select(0, torch.tensor(chain_rows)),
            [entries[i].generator for i in chains],
            [entries[i].params.is_greedy for i in chains],
        )
        for i, result in zip(chains, results, strict=True):
            verdicts[i] = Verdict(result.tokens, result.num_accepted)
    for i, (params, generator, prop) in enumerate(entries):
        if prop is not None and prop.tree is not None:
            rows = target[starts[i] : starts[i] + prop.num_tokens + 1]  # [n + 1, V]
            tree_result = verify_tree(prop.tree, prop.draft_probs, rows, generator, params.is_greedy)
            verdicts[i] = Verdict(tree_result.tokens, tree_result.num_accepted, tree_result.accepted_nodes)
    assert all(v is not None for v in verdicts)
    return verdicts  # type: ignore[return-value]


def reads_argmax_only(entries: list[VerifyEntry]) -> bool:
    """Whether verifying `entries` reads nothing of the logits but each row's argmax: greedy chains only."""
    return all(params.is_greedy and (prop is None or prop.tree is None) for params, _, prop in entries)


def _verify_greedy_chains(proposals: list[Proposal | None], argmax: list[int]) -> list[Verdict]:
    """Greedy chains only (plain decoding is a chain of k = 0): each keeps its longest prefix that matches the
    target's argmax, then the argmax after it - verify_chains' greedy result, read from one list of argmaxes
    (S ints) instead of a dozen tensor operations over the batch."""
    verdicts = []
    row = 0  # this entry's first row: argmax after its committed tokens
    for prop in proposals:
        tokens = prop.tokens if prop is not None else []
        num_accepted = 0
        while num_accepted < len(tokens) and tokens[num_accepted] == argmax[row + num_accepted]:
            num_accepted += 1
        verdicts.append(Verdict(tokens[:num_accepted] + [argmax[row + num_accepted]], num_accepted))
        row += 1 + len(tokens)
    return verdicts
