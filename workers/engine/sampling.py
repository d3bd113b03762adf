"""Turning logits into probabilities and tokens: temperature, top-k, top-p, seeded draws.

Used by plain decoding and by speculative verification, which applies the SAME transformation to the
draft's and the target's logits (lossless rejection sampling needs both distributions post-processing).
"""

import torch


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


def sample_from_probs(
    probs: torch.Tensor,  # [n, V] rows sum to 1
    generators: list[torch.Generator | None],  # [n] per-request generator (seeded) or None
) -> torch.Tensor:  # [n] long
    """One draw per row; a row with its own generator draws independently of the rest of the batch."""
    out = torch.empty(probs.shape[0], dtype=torch.long)
    for i, gen in enumerate(generators):
        out[i] = torch.multinomial(probs[i], 1, generator=gen)[0]
    return out
