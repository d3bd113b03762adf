"""A step's forward inputs as rank 0 sends them to the other tensor-parallel ranks.

Rank 0 builds the ForwardBatch (its block manager and block tables never leave it otherwise); the other ranks
receive exactly the tensors their shard's forward reads: token ids, positions, slot mapping, block tables, the
attention mask and the padding indices. They travel as a small header of sizes (sent ahead, see tp_group.py)
and two tensors broadcast from rank 0: every integer input back to back, and the mask as bytes.
"""

from dataclasses import dataclass

import torch

from workers.engine.model_runner import ForwardBatch
from workers.models.attention import AttentionMetadata


@dataclass(frozen=True)
class BatchHeader:
    """The sizes a receiving rank allocates its buffers by."""

    num_tokens: int  # T
    num_seqs: int  # B
    num_blocks_max: int  # NB: columns of the block tables
    max_query_len: int  # Q
    num_keys: int  # L: key slots per sequence in the mask
    has_query_index: bool
    has_flat_index: bool

    @property
    def num_ints(self) -> int:
        t, b, q = self.num_tokens, self.num_seqs, self.max_query_len
        return 3 * t + b * self.num_blocks_max + (b * q if self.has_query_index else 0) + (t if self.has_flat_index else 0)

    @property
    def num_mask_bytes(self) -> int:
        return self.num_seqs * self.max_query_len * self.num_keys


def pack(batch: ForwardBatch) -> tuple[BatchHeader, torch.Tensor, torch.Tensor]:
    """(header, ints [header.num_ints] long, mask [header.num_mask_bytes] uint8)."""
    meta = batch.meta
    assert meta.mask is not None, "the tensor-parallel target attends through SDPA: its runner builds the mask"
    num_seqs, _, max_q, num_keys = meta.mask.shape
    header = BatchHeader(
        num_tokens=int(batch.input_ids.shape[0]),
        num_seqs=int(num_seqs),
        num_blocks_max=int(meta.block_tables.shape[1]),
        max_query_len=int(max_q),
        num_keys=int(num_keys),
        has_query_index=meta.query_index is not None,
        has_flat_index=meta.flat_index is not None,
    )
    parts = [batch.input_ids, batch.positions, meta.slot_mapping, meta.block_tables.reshape(-1)]
    if meta.query_index is not None:
        parts.append(meta.query_index.reshape(-1))
    if meta.flat_index is not None:
        parts.append(meta.flat_index)
    ints = torch.cat(parts)  # [num_ints] long
    mask = meta.mask.contiguous().view(torch.uint8).reshape(-1)  # [B * Q * L]
    return header, ints, mask


def unpack(header: BatchHeader, ints: torch.Tensor, mask: torch.Tensor) -> ForwardBatch:
    """The ForwardBatch rank 0 packed (no logits rows: only rank 0 computes logits)."""
    t, b, q = header.num_tokens, header.num_seqs, header.max_query_len
    sizes = [t, t, t, b * header.num_blocks_max]
    sizes += [b * q] if header.has_query_index else []
    sizes += [t] if header.has_flat_index else []
    pieces = list(ints.split(sizes))
    input_ids, positions, slot_mapping, tables = pieces[:4]  # [T], [T], [T], [B * NB]
    rest = pieces[4:]
    query_index = rest.pop(0).view(b, q) if header.has_query_index else None  # [B, Q]
    flat_index = rest.pop(0) if header.has_flat_index else None  # [T]
    meta = AttentionMetadata(
        slot_mapping=slot_mapping,
        block_tables=tables.view(b, header.num_blocks_max),
        mask=mask.view(torch.bool).view(b, 1, q, header.num_keys),  # [B, 1, Q, L]
        query_index=query_index,
        flat_index=flat_index,
    )
    return ForwardBatch(input_ids, positions, meta, logits_indices=torch.empty(0, dtype=torch.long))
