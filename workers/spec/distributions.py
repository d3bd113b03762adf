"""Turning logits into distributions: temperature, top-k, top-p - ONE transform for target and draft alike.

Lossless rejection sampling needs p (target) and q (draft) after the same post-processing, or the output
would follow the wrong p; plain decoding is verification of zero draft tokens, so it uses the same path.
`row_distributions` builds each row's (temperature, top-k, top-p) from the request it belongs to;
`logits_to_probs` is the transform itself.
"""

import enum
from collections.abc import Sequence
from typing import Protocol

import torch


class RowSampling(Protocol):
    """What a distribution reads of a request's sampling settings (the engine's SamplingParams has them)."""

    temperature: float  # 0 = greedy
    top_k: int  # <= 0 = off
    top_p: float  # in (0, 1]; 1 = off

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
) -> torch.Tensor:  # [n, V] float32, rows sum to 1
    logits = logits.float()
    n, vocab = logits.shape
    is_greedy = temperature <= 0.0  # [n]
    safe_t = torch.where(is_greedy, torch.ones_like(temperature), temperature).float()
    scaled = logits / safe_t.unsqueeze(1)  # [n, V]

    needs_k = (top_k > 0) & (top_k < vocab)  # [n]
    needs_p = top_p < 1.0  # [n]
    if bool(needs_k.any()) or bool(needs_p.any()):
        sorted_logits, sorted_idx = scaled.sort(dim=-1, descending=True)  # [n, V]
        ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)  # [1, V]
        k_eff = torch.where(needs_k, top_k, torch.full_like(top_k, vocab)).unsqueeze(1)  # [n, 1]
        drop = ranks >= k_eff  # [n, V]
        sorted_probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)  # [n, V]
        # top-p: keep the smallest prefix whose mass reaches p (the token crossing p is kept)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # [n, V]
        drop |= mass_before >= top_p.unsqueeze(1)
        drop[:, 0] = False  # always keep the most likely token
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        scaled = torch.full_like(scaled, float("-inf")).scatter(1, sorted_idx, sorted_logits)

    probs = scaled.softmax(dim=-1)  # [n, V]
    if bool(is_greedy.any()):
        one_hot = torch.zeros_like(probs).scatter_(1, logits.argmax(dim=-1, keepdim=True), 1.0)
        probs = torch.where(is_greedy.unsqueeze(1), one_hot, probs)
    return probs


def row_distributions(
    logits: torch.Tensor,  # [n, V]
    row_params: Sequence[RowSampling],  # [n] the sampling settings of each row's request
    greedy_rows: GreedyRows,
) -> torch.Tensor:  # [n, V]: probabilities (float32); with GreedyRows.LOGITS, greedy rows are the logits
    """Each row's distribution under its request's temperature/top-k/top-p, for target and draft alike."""
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
    )
