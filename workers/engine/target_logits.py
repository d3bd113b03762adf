"""What verification samples from: the target's logits at the rows it reads (each sampling sequence's next token
and its draft tokens' positions), after each request's own rules, in vLLM's order:

    allowed_token_ids (allowed_tokens.py) -> logit_bias (logit_bias.py) -> penalties (penalties.py)
    -> min_tokens' held stop tokens (min_tokens.py) -> the grammar's mask (grammar.py: a token it refuses stays
    refused whatever came before)

Each rule reads a row as the position it scores, the draft tokens before it included, so verification samples
from what plain decoding with the same rules samples from. The logits the step reads logprobs from stay the
target's raw ones (a processed step works on a copy).
"""

from dataclasses import dataclass, replace

import torch

from workers.engine.allowed_tokens import keep_allowed_tokens
from workers.engine.grammar import mask_target_logits
from workers.engine.logit_bias import bias_target_logits
from workers.engine.min_tokens import hold_stop_tokens
from workers.engine.penalties import penalize_target_logits
from workers.engine.scheduler_output import ScheduledSeq
from workers.engine.sequence import Sequence


def processed_logits(
    logits: torch.Tensor,  # [S, V] the pass's logits (logprobs read these)
    verify_logits: torch.Tensor,  # [sum(1 + drafts), V] the rows verification reads (`logits` itself, or a copy)
    sampling: list[ScheduledSeq],  # [B] the sequences that sample this step, in row order
    drafts: list[list[int]],  # [B] each one's draft tokens this step, in order
    eos_token_ids: frozenset[int],
) -> torch.Tensor:  # [sum(1 + drafts), V]
    seqs = [s.seq for s in sampling]
    is_restricted = any(seq.params.allowed_token_ids for seq in seqs)
    is_biased = any(seq.params.logit_bias for seq in seqs)
    is_penalized = any(seq.params.has_penalties for seq in seqs)
    is_held = any(seq.holds_stop_tokens for seq in seqs)
    is_constrained = any(seq.grammar is not None for seq in seqs)
    if not (is_restricted or is_biased or is_penalized or is_held or is_constrained):
        return verify_logits
    if verify_logits is logits:
        verify_logits = logits.clone()
    pairs = list(zip(seqs, drafts, strict=True))
    if is_restricted:
        keep_allowed_tokens(verify_logits, [(seq.params.allowed_token_ids, len(d) + 1) for seq, d in pairs])
    if is_biased:
        bias_target_logits(verify_logits, [(seq.params.logit_bias, len(d)) for seq, d in pairs])
    if is_penalized:
        penalize_target_logits(verify_logits, [(seq.params, seq.token_ids, seq.output_start, d) for seq, d in pairs])
    if is_held:
        hold_stop_tokens(verify_logits, [(seq.params, seq.num_output_so_far, len(d))
                                         for seq, d in pairs], eos_token_ids)  # fmt: skip
    if is_constrained:
        mask_target_logits(verify_logits, [(seq.grammar, d) for seq, d in pairs])
    return verify_logits


@dataclass(frozen=True)
class ProposerRules:
    """The same rules but the grammar (the proposers mask that themselves, grammar.DraftGrammar) on a draft model's
    or EAGLE head's rows, so it drafts from (nearly) the distribution the target verifies under: a banned or
    penalized token is not drafted only to be refused. The proposer's q is what it draws from, so rejection
    sampling stays exact whatever it applies; this only moves acceptance. The additive rules (logit_bias,
    presence and frequency penalties) and min_tokens' held stop tokens transfer to any proposer; the repetition
    penalty scales logits, and only a head reading the target's own LM head (EAGLE) has the target's scale: on
    the demo pair at 35c8d74 (2026-12-05) it raised EAGLE's accepted tokens 266 -> 327 and cut the draft model's 184 -> 116,
    so the draft model does without it. A tree's rows take the bias alone: a penalized or held sequence drafts
    chains (Sequence.drafts_chains_only)."""

    eos_token_ids: frozenset[int] = frozenset()
    takes_repetition: bool = True  # the proposer's logits are on the target's scale (EAGLE)

    def apply(
        self,
        logits: torch.Tensor,  # [A, V] a proposer's logits: one row per sequence, at the position after its drafts
        seqs: list[Sequence],  # [A] the sequence of each row
        drafted: list[list[int]],  # [A] the tokens each one drafted before this row (a tree's rows: [])
    ) -> torch.Tensor:  # [A, V]
        params = [p if self.takes_repetition or p.repetition_penalty == 1.0 else replace(p, repetition_penalty=1.0)
                  for p in (seq.params for seq in seqs)]  # fmt: skip
        is_restricted = any(p.allowed_token_ids for p in params)
        is_biased = any(p.logit_bias for p in params)
        is_penalized = any(p.has_penalties for p in params)
        is_held = any(p.min_tokens for p in params)
        if not (is_restricted or is_biased or is_penalized or is_held):
            return logits
        logits = logits.clone()  # [A, V] the runner's own buffer stays as it was
        if is_restricted:
            keep_allowed_tokens(logits, [(p.allowed_token_ids, 1) for p in params])
        if is_biased:
            bias_target_logits(logits, [(p.logit_bias, 0) for p in params])
        if is_penalized:
            penalize_target_logits(logits, [(p, seq.token_ids + d, seq.output_start, [])
                                            for p, seq, d in zip(params, seqs, drafted, strict=True)])  # fmt: skip
        if is_held:
            hold_stop_tokens(logits, [(p, seq.num_output_so_far + len(d), 0)
                                      for p, seq, d in zip(params, seqs, drafted, strict=True)], self.eos_token_ids)  # fmt: skip
        return logits


def reads_only_raw_logits(seqs: list[ScheduledSeq]) -> bool:
    """Whether no rule above and no logprobs touch this step's logits (a CUDA step may then keep them on the
    device and read each row's argmax alone)."""
    return not any(
        s.seq.grammar is not None or s.seq.params.logprobs is not None or s.seq.params.prompt_logprobs is not None
        or s.seq.params.logit_bias or s.seq.params.has_penalties or s.seq.params.min_tokens
        or s.seq.params.allowed_token_ids
        for s in seqs
    )
