"""vLLM's `allowed_token_ids`: a request samples only among these tokens; every other token's logit is -inf at
each row verification reads (and on the proposers' rows, ProposerRules), so plain decoding and speculation
sample from the same restricted distribution (greedy output token-identical with speculation on and off). The
rule is the same at every position, so such a sequence may draft trees. The logprobs a request asks for stay the
target's raw ones (vLLM's default), as under logit_bias and a grammar.
"""

import torch

from workers.engine.errors import InvalidRequestError


def check_allowed_tokens(
    allowed: object, vocab_size: int, min_tokens: int, stop_ids: frozenset[int]
) -> None:
    """InvalidRequestError naming `allowed_token_ids` unless it is None or a non-empty list of ids in
    [0, vocab_size) of which one, while min_tokens holds the stop tokens back, does not stop the output."""
    if allowed is None:
        return
    if not isinstance(allowed, list) or not allowed:
        raise InvalidRequestError("allowed_token_ids", "must be a non-empty list of token ids (or null)")
    for token in allowed:
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab_size:
            raise InvalidRequestError("allowed_token_ids", f"token ids must be integers in [0, {vocab_size}), got {token!r}")
    if min_tokens and set(allowed) <= stop_ids:
        raise InvalidRequestError(
            "allowed_token_ids", "every allowed token ends the output, which min_tokens forbids before its count"
        )


def keep_allowed_tokens(
    logits: torch.Tensor,  # [S, V] logits: each entry's rows, entries in order
    entries: list[tuple[list[int] | None, int]],  # [B] (the request's allowed ids or None, its number of rows)
) -> None:
    """Set every token a request does not allow to -inf, in place, on each of its rows."""
    row = 0
    with torch.inference_mode():  # the runner's logits are inference tensors
        for allowed, num_rows in entries:
            if allowed:
                ids = torch.tensor(allowed, dtype=torch.long, device=logits.device)  # [K]
                kept = logits[row : row + num_rows, ids].clone()  # [n, K]
                logits[row : row + num_rows] = float("-inf")
                logits[row : row + num_rows, ids] = kept
            row += num_rows
