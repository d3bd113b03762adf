"""Llama-family decoder (Llama, Qwen2, Mistral layouts) over a paged KV cache.

Weights come from a Hugging Face checkpoint (see loader.py); q/k/v and gate/up projections are fused
into one matmul each. The model computes logits only for the rows the caller asks for.
"""

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from workers.models.attention import AttentionMetadata, attend_paged
from workers.models.config import ModelConfig
from workers.models.packed_linear import Linear, linear
from workers.models.rope import apply_rope, rope_table

# one layer's attention: (q [T, H, D] rotated, k [T, KV, D] rotated, v [T, KV, D]) -> [T, H * D]; it also
# writes k and v into the layer's paged cache
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        if x.dtype in (torch.float32, torch.float64):  # one fused op, same arithmetic as the reference
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        x32 = x.float()  # half precision: normalise in float32, scale after casting back (as transformers)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qkv_split = (q_size, kv_size, kv_size)
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.qkv = Linear(cfg.hidden_size, q_size + 2 * kv_size, bias=cfg.qkv_bias)
        self.o_proj = Linear(q_size, cfg.hidden_size, bias=cfg.o_bias)
        self.post_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.gate_up = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down = Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(
        self,
        h: torch.Tensor,  # [T, hidden]
        cos: torch.Tensor,  # [T, D]
        sin: torch.Tensor,  # [T, D]
        attend: Attend,  # this layer's attention: writes k/v into its paged cache, returns [T, H * D]
    ) -> torch.Tensor:  # [T, hidden]
        num_tokens, num_qk_heads = h.shape[0], self.num_heads + self.num_kv_heads
        # linear(): no nn.Module call overhead on this hot path, and the prepacked weight where there is one
        qkv = linear(self.input_norm(h), self.qkv)  # [T, (H + 2 KV) * D]
        qkv = qkv.view(num_tokens, num_qk_heads + self.num_kv_heads, self.head_dim)  # [T, H + 2 KV, D]
        qk = apply_rope(qkv[:, :num_qk_heads], cos, sin)  # [T, H + KV, D]: q and k rotated together
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]  # [T, H, D], [T, KV, D]
        attn = attend(q, k, qkv[:, num_qk_heads:])  # [T, H * D]
        h = h + linear(attn, self.o_proj)
        gate_up = linear(self.post_norm(h), self.gate_up)  # [T, 2 I]
        gate, up = gate_up.chunk(2, dim=-1)  # [T, I] each
        return h + linear(F.silu(gate) * up, self.down)


def eager_attend(
    meta: AttentionMetadata, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float
) -> Attend:
    """Attention called from Python over one layer's cache ([num_blocks, block_size, KV, D] each)."""

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return attend_paged(q, k, v, k_cache, v_cache, meta, scale)

    return attend


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn_scale = cfg.head_dim**-0.5  # softmax scale of every layer
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.cos_table = torch.empty(0)  # [max_len, D], set by init_rope
        self.sin_table = torch.empty(0)  # [max_len, D]

    def init_rope(self, max_len: int) -> None:
        """Precompute cos/sin for positions [0, max_len) in the weights' dtype, on their device."""
        weight = self.embed.weight
        cos, sin = rope_table(self.cfg, max_len, weight.dtype)  # computed on the CPU: the same table anywhere
        self.cos_table, self.sin_table = cos.to(weight.device), sin.to(weight.device)

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, int, int, int]:
        return (num_blocks, block_size, self.cfg.num_kv_heads, self.cfg.head_dim)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] long
        positions: torch.Tensor,  # [T] long
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # per layer (k, v) [num_blocks, block_size, KV, D]
        logits_indices: torch.Tensor,  # [S] long: rows of T whose next-token logits are wanted
    ) -> torch.Tensor:  # [S, V] float32
        """The eager path: every op dispatched from Python."""
        attends = [eager_attend(meta, k, v, self.attn_scale) for k, v in kv_caches]
        return self.logits(self.hidden_states(input_ids, positions, attends), logits_indices)

    def hidden_states(
        self,
        input_ids: torch.Tensor,  # [T] long
        positions: torch.Tensor,  # [T] long
        attends: Sequence[Attend],  # one per layer
    ) -> torch.Tensor:  # [T, hidden]: the last layer's output, before the final norm
        """The dense path (what workers/models/compiled.py compiles, attention left opaque)."""
        h = self.embed(input_ids)  # [T, hidden]
        cos, sin = self.cos_table[positions], self.sin_table[positions]  # [T, D] each
        for layer, attend in zip(self.layers, attends, strict=True):
            h = layer(h, cos, sin, attend)
        return h

    def logits(
        self,
        h: torch.Tensor,  # [T, hidden]
        logits_indices: torch.Tensor,  # [S] long
    ) -> torch.Tensor:  # [S, V] float32
        h = self.norm(h.index_select(0, logits_indices))  # [S, hidden]
        return linear(h, self.lm_head).float()  # [S, V]
