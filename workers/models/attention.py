"""Paged attention over a block-table KV cache: the native kernel where it serves, else plain PyTorch ops.

The KV cache of one layer is two tensors [num_blocks, block_size, num_kv_heads, head_dim]. A step's
new tokens arrive flat ([T, ...], every sequence's query tokens back to back). Two paths:

- native (native_attention.py, when the runner has the kernel): one call writes the new K/V and attends
  per query token over the key positions it sees (a range of its sequence, plus its ancestors' slots in a
  token tree), read in place through the block table;
- SDPA: each sequence's keys are gathered block-wise through its block table and scored with one
  scaled_dot_product_attention call for the whole ragged batch, padded to its longest query, under a
  boolean mask that encodes causality (or a token tree) and padding.
"""

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from workers.models.native_attention import NativeAttention


@dataclass
class AttentionMetadata:
    """Built once per step by the model runner, shared by every layer."""

    slot_mapping: torch.Tensor  # [T] long: flat KV slot (block * block_size + offset) each new token writes
    block_tables: torch.Tensor  # [B, num_blocks_max] long: each sequence's blocks, padded with block 0
    # the SDPA path's padded view; None where the native kernel serves the pass
    mask: torch.Tensor | None  # [B, 1, Q, L] bool: query q of sequence b may attend key slot l (L = NB * block_size)
    query_index: torch.Tensor | None  # [B, Q] long: flat token of each padded query; None = flat is already [B*Q]
    flat_index: torch.Tensor | None  # [T] long: row of [B*Q] holding each flat token; None = identity
    # the native path's ragged view: token t sees key positions [key_start, key_end) of its sequence and,
    # in a token tree, tree_base + j for every bit j set in tree_bits (None where the kernel can't serve)
    token_seq: torch.Tensor | None = None  # [T] long: the row of block_tables of each token's sequence
    key_start: torch.Tensor | None = None  # [T] long: first key position (in its sequence) the token sees
    key_end: torch.Tensor | None = None  # [T] long: one past the last of its range (causal: its position + 1)
    tree_base: torch.Tensor | None = None  # [T] long: a tree query's first tree slot position (else 0)
    tree_bits: torch.Tensor | None = None  # [T] long: the tree slots it sees, bit j = tree_base + j (else 0)
    native: NativeAttention | None = None  # the kernel, where it serves this pass

    def to(self, device: torch.device) -> "AttentionMetadata":
        """The same metadata with every tensor on `device` (the pass's model's)."""
        tensors = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        moved: dict[str, Any] = {name: t.to(device) for name, t in tensors.items() if isinstance(t, torch.Tensor)}
        return dataclasses.replace(self, **moved)

    @property
    def num_seqs(self) -> int:
        return int(self.block_tables.shape[0])

    @property
    def max_query_len(self) -> int:
        assert self.mask is not None, "the SDPA path's metadata"
        return int(self.mask.shape[2])


def attend_paged(
    q: torch.Tensor,  # [T, H, D] rotated
    k: torch.Tensor,  # [T, KV, D] rotated
    v: torch.Tensor,  # [T, KV, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, KV, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, KV, D]
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [T, H * D]
    """One layer's attention: write this pass's K/V into the layer's cache, attend over it."""
    if meta.native is not None:
        seqs, starts, ends, bases, bits = meta.token_seq, meta.key_start, meta.key_end, meta.tree_base, meta.tree_bits
        assert seqs is not None and starts is not None and ends is not None and bases is not None and bits is not None
        ragged = (seqs, starts, ends, bases, bits)
        return meta.native.attend(q, k, v, k_cache, v_cache, meta.slot_mapping, meta.block_tables, ragged, scale)
    write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
    return paged_attention(q, k_cache, v_cache, meta, scale)


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
    assert meta.mask is not None
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
