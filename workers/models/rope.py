"""Rotary position embeddings (default, linear and llama3 frequency schedules), as a cos/sin table."""

import math

import torch

from workers.models.config import ModelConfig


def inverse_frequencies(cfg: ModelConfig) -> torch.Tensor:  # [head_dim // 2] float32
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = cfg.rope_scaling
    if scaling is None:
        return inv_freq
    rope_type = scaling.get("rope_type")
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "llama3":
        return _llama3_frequencies(inv_freq, scaling)
    raise ValueError(f"unsupported rope_type {rope_type!r}")


def _llama3_frequencies(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1: long wavelengths divided by `factor`, short ones kept, a smooth blend in between."""
    factor = float(scaling["factor"])
    low_factor = float(scaling["low_freq_factor"])
    high_factor = float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    low_wavelen = old_len / low_factor
    high_wavelen = old_len / high_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low_factor) / (high_factor - low_factor)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, blended, scaled)


def rope_table(cfg: ModelConfig, max_len: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin tables [max_len, head_dim] in `dtype` (computed in float32 like the reference)."""
    inv_freq = inverse_frequencies(cfg)  # [D/2]
    positions = torch.arange(max_len, dtype=torch.float32)  # [L]
    freqs = torch.outer(positions, inv_freq)  # [L, D/2]
    emb = torch.cat([freqs, freqs], dim=-1)  # [L, D]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(
    x: torch.Tensor,  # [T, heads, D]
    cos: torch.Tensor,  # [T, D]
    sin: torch.Tensor,  # [T, D]
) -> torch.Tensor:  # [T, heads, D]
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)  # rotate_half
    return x * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)
