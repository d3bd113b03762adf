"""vLLM's `min_tokens`: no EOS (unless `ignore_eos`, where EOS stops nothing) and no `stop_token_ids` before the
output has `min_tokens` tokens. Their logits are -inf at each row verification reads whose position comes
before that (the output so far plus the draft tokens before the row), so verification samples from what plain
decoding with the rule samples from (greedy output token-identical with speculation on and off). A stop string
that ends in the text of the first min_tokens tokens does not end the output either (apply.py, as vLLM's
detokenizer since vllm-project/vllm#22014); a grammar's end still does. A resumed job counts the output it
already had.
"""

import torch

from workers.engine.sampling_params import SamplingParams

HoldEntry = tuple[SamplingParams, int, int]  # params, output tokens so far, draft tokens this step


def stop_token_set(params: SamplingParams, eos_token_ids: frozenset[int]) -> frozenset[int]:
    """The tokens that end a request's output: its stop_token_ids, and EOS unless it ignores EOS."""
    return frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else eos_token_ids)


def hold_stop_tokens(
    logits: torch.Tensor,  # [S, V] the target's logits: each entry's 1 + drafts rows, entries in order
    entries: list[HoldEntry],  # [B] one per verified sequence, in order
    eos_token_ids: frozenset[int],
) -> None:
    """Refuse the stop tokens, in place, at every row whose position is short of its sequence's min_tokens."""
    row = 0
    with torch.inference_mode():  # the runner's logits are inference tensors
        for params, num_output, num_drafts in entries:
            num_held = min(num_drafts + 1, params.min_tokens - num_output)  # rows r with num_output + r < min
            if num_held > 0:
                stops = stop_token_set(params, eos_token_ids)
                ids = torch.tensor(sorted(stops), dtype=torch.long, device=logits.device)  # [K]
                logits[row : row + num_held, ids] = float("-inf")
            row += num_drafts + 1
