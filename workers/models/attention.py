"""Paged attention over a block-table KV cache, in plain PyTorch ops.

The KV cache of one layer is two tensors [num_blocks, block_size, num_kv_heads, head_dim]. A step's
new tokens arrive flat ([T, ...], every sequence's query tokens back to back); each sequence's keys are
gathered block-wise through its block table and scored with one scaled_dot_product_attention call for
the whole ragged batch, under a boolean mask that encodes causality (or a token tree) and padding.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    """Built once per step by the model runner, shared by every layer."""

    slot_mapping: torch.Tensor  # [T] long: flat KV slot (block * block_size + offset) each new token writes
    block_tables: torch.Tensor  # [B, num_blocks_max] long: each sequence's blocks, padded with block 0
    mask: torch.Tensor  # [B, 1, Q, L] bool: query q of sequence b may attend key slot l (L = blocks * block_size)
    query_index: torch.Tensor | None  # [B, Q] long: flat token of each padded query; None = flat is already [B*Q]
    flat_index: torch.Tensor | None  # [T] long: row of [B*Q] holding each flat token; None = identity

    @property
    def num_seqs(self) -> int:
        return int(self.block_tables.shape[0])

    @property
    def max_query_len(self) -> int:
        return int(self.mask.shape[2])


def write_kv(
    k_cache: torch.Tensor,  # [num_blocks, block_size, KV, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, KV, D]
    k: torch.Tensor,  # [T, KV, D]
    v: torch.Tensor,  # [T, KV, D]
    slot_mapping: torch.Tensor,  # [T] long
) -> None:
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    k_cache.view(num_slots, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k)
    v_cache.view(num_slots, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v)


def paged_attention(
    q: torch.Tensor,  # [T, H, D] (rotary already applied)
    k_cache: torch.Tensor,  # [num_blocks, block_size, KV, D] (this step's keys already written)
    v_cache: torch.Tensor,  # [num_blocks, block_size, KV, D]
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [T, H * D]
    num_tokens, num_heads, head_dim = q.shape
    batch, max_q = meta.num_seqs, meta.max_query_len
    if meta.query_index is None:
        q_pad = q.view(batch, max_q, num_heads, head_dim)  # [B, Q, H, D]
    else:
        q_pad = q[meta.query_index]  # [B, Q, H, D]
    flat_blocks = meta.block_tables.reshape(-1)  # [B * NB]
    keys = k_cache.index_select(0, flat_blocks).view(batch, -1, *k_cache.shape[2:])  # [B, L, KV, D]
    values = v_cache.index_select(0, flat_blocks).view(batch, -1, *v_cache.shape[2:])  # [B, L, KV, D]
    out = F.scaled_dot_product_attention(
        q_pad.transpose(1, 2),  # [B, H, Q, D]
        keys.transpose(1, 2),  # [B, KV, L, D]
        values.transpose(1, 2),  # [B, KV, L, D]
        attn_mask=meta.mask,
        scale=scale,
        enable_gqa=num_heads != k_cache.shape[2],
    )  # [B, H, Q, D]
    out = out.transpose(1, 2).reshape(batch * max_q, num_heads * head_dim)  # [B * Q, H * D]
    if meta.flat_index is not None:
        out = out.index_select(0, meta.flat_index)  # [T, H * D]
    return out
