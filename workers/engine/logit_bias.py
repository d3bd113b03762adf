"""OpenAI's `logit_bias`: a request's bias, added to the target's logits at every position it samples, before
temperature, top-k and top-p (as OpenAI and vLLM apply it).

The bias goes where verification reads (the rows of the target's logits that sample a token: the next token
and each draft token's position), so what verification samples from is exactly the distribution plain
decoding with the bias samples from: greedy output is token-identical with speculation on and off, and
rejection sampling stays lossless whatever the draft proposed (the draft itself reads no bias: a token the bias
lowers is drafted and refused as often as the target now refuses it). A -100 bans a token in practice, a +100
all but forces it. The logprobs a request asks for stay the target's raw ones (vLLM's default), as under a
grammar.
"""

import torch

from shared.schemas import MAX_LOGIT_BIAS_TOKENS
from workers.engine.errors import InvalidRequestError

MAX_BIAS = 100.0  # OpenAI's range: [-100, 100]


def check_logit_bias(bias: object, vocab_size: int) -> None:
    """Raise InvalidRequestError naming `logit_bias` unless it maps token ids in [0, vocab_size) to finite
    numbers in [-100, 100] (at most 300 of them)."""
    if bias is None:
        return
    if not isinstance(bias, dict) or len(bias) > MAX_LOGIT_BIAS_TOKENS:
        raise InvalidRequestError("logit_bias", f"must map at most {MAX_LOGIT_BIAS_TOKENS} token ids to a bias")
    for token, value in bias.items():
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab_size:
            raise InvalidRequestError("logit_bias", f"token ids must be integers in [0, {vocab_size}), got {token!r}")
        if isinstance(value, bool) or not isinstance(value, int | float) or not -MAX_BIAS <= value <= MAX_BIAS:
            raise InvalidRequestError("logit_bias", f"a bias is a number in [-100, 100], got {value!r} for {token}")


def bias_target_logits(
    logits: torch.Tensor,  # [S, V] the target's logits: each entry's 1 + len(drafts) rows, entries in order
    entries: list[tuple[dict[int, float] | None, int]],  # [B] (the request's bias or None, its draft tokens)
) -> None:
    """Add each biased request's bias, in place, to every row it verifies."""
    row = 0
    with torch.inference_mode():  # the runner's logits are inference tensors
        for bias, num_drafts in entries:
            num_rows = num_drafts + 1
            if bias:
                ids = torch.tensor(list(bias), dtype=torch.long, device=logits.device)  # [K]
                values = torch.tensor(list(bias.values()), dtype=logits.dtype, device=logits.device)  # [K]
                logits[row : row + num_rows].index_add_(1, ids, values.expand(num_rows, -1))
            row += num_rows
