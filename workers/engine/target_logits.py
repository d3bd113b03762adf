"""What verification samples from: the target's logits at the rows it reads (each sampling sequence's next token
and its draft tokens' positions), after each request's own rules, in vLLM's order:

    logit_bias (logit_bias.py) -> penalties (penalties.py) -> min_tokens' held stop tokens (min_tokens.py)
    -> the grammar's mask (grammar.py: a token it refuses stays refused whatever came before)

Each rule reads a row as the position it scores, the draft tokens before it included, so verification samples
from what plain decoding with the same rules samples from. The logits the step reads logprobs from stay the
target's raw ones (a processed step works on a copy).
"""

import torch

from workers.engine.grammar import mask_target_logits
from workers.engine.logit_bias import bias_target_logits
from workers.engine.min_tokens import hold_stop_tokens
from workers.engine.penalties import penalize_target_logits
from workers.engine.scheduler_output import ScheduledSeq


def processed_logits(
    logits: torch.Tensor,  # [S, V] the pass's logits (logprobs read these)
    verify_logits: torch.Tensor,  # [sum(1 + drafts), V] the rows verification reads (`logits` itself, or a copy)
    sampling: list[ScheduledSeq],  # [B] the sequences that sample this step, in row order
    drafts: list[list[int]],  # [B] each one's draft tokens this step, in order
    eos_token_ids: frozenset[int],
) -> torch.Tensor:  # [sum(1 + drafts), V]
    seqs = [s.seq for s in sampling]
    is_biased = any(seq.params.logit_bias for seq in seqs)
    is_penalized = any(seq.params.has_penalties for seq in seqs)
    is_held = any(seq.holds_stop_tokens for seq in seqs)
    is_constrained = any(seq.grammar is not None for seq in seqs)
    if not (is_biased or is_penalized or is_held or is_constrained):
        return verify_logits
    if verify_logits is logits:
        verify_logits = logits.clone()
    pairs = list(zip(seqs, drafts, strict=True))
    if is_biased:
        bias_target_logits(verify_logits, [(seq.params.logit_bias, len(d)) for seq, d in pairs])
    if is_penalized:
        penalize_target_logits(verify_logits, [(seq.params, seq.token_ids, seq.output_start, d) for seq, d in pairs])
    if is_held:
        hold_stop_tokens(verify_logits, [(seq.params, len(seq.token_ids) - seq.output_start, len(d))
                                         for seq, d in pairs], eos_token_ids)  # fmt: skip
    if is_constrained:
        mask_target_logits(verify_logits, [(seq.grammar, d) for seq, d in pairs])
    return verify_logits


def reads_only_raw_logits(seqs: list[ScheduledSeq]) -> bool:
    """Whether no rule above and no logprobs touch this step's logits (a CUDA step may then keep them on the
    device and read each row's argmax alone)."""
    return not any(
        s.seq.grammar is not None or s.seq.params.logprobs is not None or s.seq.params.prompt_logprobs is not None
        or s.seq.params.logit_bias or s.seq.params.has_penalties or s.seq.params.min_tokens
        for s in seqs
    )
