"""OpenAI's `presence_penalty` and `frequency_penalty`, and vLLM's `repetition_penalty`, applied to the target's
logits at every row verification reads, before temperature, top-k and top-p (after `logit_bias`, as vLLM):

    presence/frequency (OpenAI):  logit[t] -= frequency * count[t] + presence * (count[t] > 0)
                                  count: how often t is in the output before this position
    repetition (vLLM, from CTRL): logit[t] /= r where logit[t] > 0, else *= r, for t in the prompt or the output

A row's counts are the output's so far plus the draft tokens before that row, so verification samples from
exactly what plain decoding with the penalties samples from (greedy output is token-identical with speculation
on and off). That needs the draft tokens in order: a penalized sequence drafts chains, never trees (as a
constrained one does, Sequence.drafts_chains_only). The output includes what a resumed job had already written
(its last `num_resumed_tokens` prompt tokens). The draft reads no penalty; logprobs stay the target's raw ones.
"""

import torch

from workers.engine.sampling_params import SamplingParams

PenaltyEntry = tuple[SamplingParams, list[int], int, list[int]]  # params, prompt + output, output start, drafts


def penalize_target_logits(
    logits: torch.Tensor,  # [S, V] the target's logits: each entry's 1 + len(drafts) rows, entries in order
    entries: list[PenaltyEntry],  # [B] one per verified sequence, in order
) -> None:
    """Apply each penalized sequence's penalties, in place, to every row it verifies."""
    row = 0
    with torch.inference_mode():  # the runner's logits are inference tensors
        for params, token_ids, output_start, drafts in entries:
            num_rows = len(drafts) + 1
            if params.has_penalties:
                _penalize(logits[row : row + num_rows], params, token_ids, output_start, drafts)
            row += num_rows


def _penalize(
    rows: torch.Tensor,  # [k + 1, V] a view of one sequence's rows
    params: SamplingParams,
    token_ids: list[int],  # [L] prompt + output so far
    output_start: int,  # where the output starts in token_ids
    drafts: list[int],  # [k] this step's draft tokens, in order
) -> None:
    num_rows, vocab = rows.shape
    ids = torch.tensor(token_ids, dtype=torch.long, device=rows.device)  # [L]
    counts = torch.bincount(ids[output_start:], minlength=vocab)[:vocab].expand(num_rows, vocab).clone()  # [k+1, V]
    if drafts:  # row r also counts drafts[:r]
        steps = torch.zeros(num_rows, vocab, dtype=torch.long, device=rows.device)  # [k+1, V]
        steps[torch.arange(1, num_rows, device=rows.device), torch.tensor(drafts, device=rows.device)] = 1
        counts += steps.cumsum(0)
    if params.repetition_penalty != 1.0:
        seen = counts > 0  # [k+1, V]
        seen[:, ids[:output_start]] = True  # the prompt's tokens too
        penalized = torch.where(rows > 0, rows / params.repetition_penalty, rows * params.repetition_penalty)
        rows.copy_(torch.where(seen, penalized, rows))
    if params.frequency_penalty or params.presence_penalty:
        rows -= params.frequency_penalty * counts.to(rows.dtype) + params.presence_penalty * (counts > 0).to(rows.dtype)
