"""Picks each sequence's next token from its logits: argmax for greedy rows, seeded draws otherwise."""

import torch

from workers.engine.sampling import logits_to_probs, sample_from_probs
from workers.engine.sequence import Sequence


def sample_next_tokens(
    logits: torch.Tensor,  # [S, V] float32, one row per sequence in `seqs`
    seqs: list[Sequence],
) -> list[int]:
    tokens = logits.argmax(dim=-1)  # [S]
    random_rows = [i for i, seq in enumerate(seqs) if not seq.params.is_greedy]
    if random_rows:
        rows = torch.tensor(random_rows)
        params = [seqs[i].params for i in random_rows]
        probs = logits_to_probs(
            logits.index_select(0, rows),
            temperature=torch.tensor([p.temperature for p in params], dtype=torch.float32),
            top_k=torch.tensor([p.top_k for p in params], dtype=torch.long),
            top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32),
        )  # [R, V]
        tokens[rows] = sample_from_probs(probs, [seqs[i].generator for i in random_rows])
    return tokens.tolist()
