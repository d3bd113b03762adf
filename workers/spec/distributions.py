"""Turning logits into distributions: temperature, min-p, top-k, top-p - ONE transform for target and draft alike.

Lossless rejection sampling needs p (target) and q (draft) after the same post-processing, or the output
would follow the wrong p; plain decoding is verification of zero draft tokens, so it uses the same path.
`row_distributions` builds each row's (temperature, min-p, top-k, top-p) from the request it belongs to;
`logits_to_probs` is the transform itself, in vLLM's order: temperature, then min-p (a token less likely than
min_p times the row's likeliest is dropped), then top-k and top-p over what min-p kept.
"""

import enum
from collections.abc import Sequence
from typing import Protocol

import torch

TOP_CANDIDATES = 256  # top-k/top-p rank a row over its 256 likeliest tokens first (see _keep_top_k_top_p)


class RowSampling(Protocol):
    """What a distribution reads of a request's sampling settings (the engine's SamplingParams has them)."""

    temperature: float  # 0 = greedy
    top_k: int  # <= 0 = off
    top_p: float  # in (0, 1]; 1 = off
    min_p: float  # in [0, 1]; 0 = off

    @property
    def is_greedy(self) -> bool: ...


class GreedyRows(enum.Enum):
    """What a greedy request's rows become (sampling rows always get their request's full transform)."""

    ONE_HOT = "one_hot"  # one-hot at the argmax: the token a greedy draft chain proposes
    SOFTMAX = "softmax"  # temperature 1 with the request's top-k/top-p: ranks candidates of a greedy tree
    LOGITS = "logits"  # left as the logits (only their argmax is read): the target; sampling rows alone transformed


def logits_to_probs(
    logits: torch.Tensor,  # [n, V] float
    temperature: torch.Tensor,  # [n] float; rows with 0 are greedy -> one-hot at argmax
    top_k: torch.Tensor,  # [n] long; <= 0 = off
    top_p: torch.Tensor,  # [n] float in (0, 1]; 1 = off
    min_p: torch.Tensor | None = None,  # [n] float in [0, 1]; 0 (or None: every row) = off
) -> torch.Tensor:  # [n, V] float32, rows sum to 1
    logits = logits.float()
    n, vocab = logits.shape
    is_greedy = temperature <= 0.0  # [n]
    safe_t = torch.where(is_greedy, torch.ones_like(temperature), temperature).float()
    scaled = logits / safe_t.unsqueeze(1)  # [n, V]
    if min_p is not None and bool((min_p > 0.0).any()):
        # p_i < min_p * p_max  <=>  logit_i - logit_max < log(min_p): the softmax's normaliser cancels out
        floor = scaled.amax(dim=-1, keepdim=True) + min_p.float().log().unsqueeze(1)  # [n, 1]; -inf where off
        scaled = scaled.masked_fill(scaled < floor, float("-inf"))  # [n, V]; the likeliest token always stays

    needs_k = (top_k > 0) & (top_k < vocab)  # [n]
    needs_p = top_p < 1.0  # [n]
    needs_filter = needs_k | needs_p  # [n]
    if bool(needs_filter.any()):
        rows = needs_filter.nonzero().squeeze(1)  # [m] the rows top-k or top-p cut; the rest stay whole
        k_eff = torch.where(needs_k, top_k, torch.full_like(top_k, vocab))[rows]  # [m]
        scaled[rows] = _keep_top_k_top_p(scaled[rows], k_eff, top_p[rows])

    probs = scaled.softmax(dim=-1)  # [n, V]
    if bool(is_greedy.any()):
        one_hot = torch.zeros_like(probs).scatter_(1, logits.argmax(dim=-1, keepdim=True), 1.0)
        probs = torch.where(is_greedy.unsqueeze(1), one_hot, probs)
    return probs


def _keep_top_k_top_p(
    scaled: torch.Tensor,  # [n, V] float logits after temperature
    k_eff: torch.Tensor,  # [n] long: tokens top-k keeps (V = off)
    top_p: torch.Tensor,  # [n] float (1 = off)
) -> torch.Tensor:  # [n, V]: the logits, -inf where top-k or top-p drops the token
    """Rank each row's tokens, keep its top k, then the smallest prefix of those whose mass reaches top_p
    (the token crossing it is kept, and always the likeliest). A full sort of the vocabulary costs ~60 ns a
    logit on a CPU (15 ms for 64 rows of 4,096), so a row is ranked over its TOP_CANDIDATES likeliest tokens
    (topk) where the cut may fall among them: top-k is on, or C tokens at the row's highest probability could
    reach top_p. A row whose prefix reaches past its candidates after all, or never could (a flat
    distribution), is sorted whole."""
    vocab = scaled.shape[1]
    num_candidates = min(vocab, max(TOP_CANDIDATES, int(k_eff.masked_fill(k_eff >= vocab, 0).max())))
    log_norm = scaled.logsumexp(dim=-1)  # [n]
    max_prob = (scaled.amax(dim=-1) - log_norm).exp()  # [n]
    by_candidates = (k_eff < vocab) | (max_prob * num_candidates >= top_p)  # [n]
    kept = torch.empty_like(scaled)
    rows = by_candidates.nonzero().squeeze(1)  # [m]
    if len(rows):
        part = scaled[rows]  # [m, V]
        kept[rows], is_settled = _prefix_kept(*part.topk(num_candidates, dim=-1), part, log_norm[rows], k_eff[rows], top_p[rows])
        by_candidates[rows[~is_settled]] = False  # its prefix reaches past the candidates
    rows = (~by_candidates).nonzero().squeeze(1)  # [r]
    if len(rows):
        part = scaled[rows]  # [r, V]
        kept[rows], _ = _prefix_kept(*part.sort(dim=-1, descending=True), part, log_norm[rows], k_eff[rows], top_p[rows])
    return kept


def _prefix_kept(
    cand_logits: torch.Tensor,  # [n, C] each row's C likeliest logits, descending
    cand_idx: torch.Tensor,  # [n, C] their token ids
    scaled: torch.Tensor,  # [n, V] the whole rows
    log_norm: torch.Tensor,  # [n] logsumexp of the whole rows
    k_eff: torch.Tensor,  # [n]
    top_p: torch.Tensor,  # [n]
) -> tuple[torch.Tensor, torch.Tensor]:  # [n, V] logits with the dropped ones -inf; [n] bool: the row is settled
    num_candidates = cand_logits.shape[1]
    ranks = torch.arange(num_candidates, device=scaled.device).unsqueeze(0)  # [1, C]
    drop = ranks >= k_eff.unsqueeze(1)  # [n, C]
    masked = cand_logits.masked_fill(drop, float("-inf"))  # [n, C]
    # top-p weighs the tokens top-k kept (all among the candidates), or the whole row when top-k is off
    has_k = k_eff < scaled.shape[1]  # [n]
    probs = (masked - torch.where(has_k, masked.logsumexp(dim=-1), log_norm).unsqueeze(1)).exp()  # [n, C]
    mass = probs.cumsum(dim=-1)  # [n, C]
    drop |= (mass - probs) >= top_p.unsqueeze(1)  # the mass before a token already reached p
    drop[:, 0] = False  # always keep the most likely token
    # settled: every token past the candidates is dropped - by top-k, or because p was reached within them
    is_settled = has_k | (mass[:, -1] >= top_p) | (num_candidates == scaled.shape[1])  # [n]
    kept = torch.full_like(scaled, float("-inf")).scatter(1, cand_idx, cand_logits.masked_fill(drop, float("-inf")))
    return kept, is_settled


def row_distributions(
    logits: torch.Tensor,  # [n, V]
    row_params: Sequence[RowSampling],  # [n] the sampling settings of each row's request
    greedy_rows: GreedyRows,
) -> torch.Tensor:  # [n, V]: probabilities (float32); with GreedyRows.LOGITS, greedy rows are the logits
    """Each row's distribution under its request's temperature/min-p/top-k/top-p, for target and draft alike."""
    if greedy_rows is GreedyRows.LOGITS:
        sampling_rows = [i for i, p in enumerate(row_params) if not p.is_greedy]
        if not sampling_rows:
            return logits
        rows = torch.tensor(sampling_rows)  # [m]
        out = logits.clone()  # [n, V]
        out[rows] = _transform(logits.index_select(0, rows), [row_params[i] for i in sampling_rows], greedy_rows)
        return out
    return _transform(logits, row_params, greedy_rows)


def _transform(
    logits: torch.Tensor,  # [n, V]
    row_params: Sequence[RowSampling],  # [n]
    greedy_rows: GreedyRows,
) -> torch.Tensor:  # [n, V] float32
    temperature = torch.tensor([p.temperature for p in row_params], dtype=torch.float32)  # [n]
    if greedy_rows is GreedyRows.SOFTMAX:
        temperature = torch.where(temperature == 0.0, torch.ones_like(temperature), temperature)
    return logits_to_probs(
        logits,
        temperature=temperature,
        top_k=torch.tensor([p.top_k for p in row_params], dtype=torch.long),  # [n]
        top_p=torch.tensor([p.top_p for p in row_params], dtype=torch.float32),  # [n]
        min_p=torch.tensor([p.min_p for p in row_params], dtype=torch.float32),  # [n]
    )
