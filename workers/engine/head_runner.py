"""Runs an EAGLE head (workers/models/eagle_head.py) over its own one-layer paged KV cache.

The head's cache has the target's block ids (BlockManager): row t of a sequence lives in the slot of
position t of its block table. Inputs are ForwardItems like the target's, plus one feature row per query
token, flat in the same order.
"""

import torch

from workers.engine.model_runner import ForwardItem, ThreadPolicy, build_batch
from workers.models.eagle_head import EagleHead


class HeadRunner:
    def __init__(self, head: EagleHead, num_blocks: int, block_size: int, threads: ThreadPolicy | None = None) -> None:
        self.head = head
        self.threads = threads
        self.block_size = block_size
        dtype = head.fc.weight.dtype
        shape = head.kv_cache_shape(num_blocks, block_size)
        self.kv_cache = (torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))

    @staticmethod
    def kv_bytes_per_block(head: EagleHead, block_size: int) -> int:
        cfg = head.cfg
        return 2 * block_size * cfg.num_kv_heads * cfg.head_dim * head.fc.weight.element_size()

    @torch.inference_mode()
    def forward(
        self,
        items: list[ForwardItem],
        features: torch.Tensor,  # [T, hidden]: one row per query token, items back to back
    ) -> tuple[torch.Tensor, torch.Tensor]:  # ([S, V] float32 logits, [S, hidden] h of the same rows)
        batch = build_batch(items, self.block_size, self.head.layer_cfg.sliding_window)
        if features.shape[0] != batch.input_ids.shape[0]:
            raise ValueError(f"{features.shape[0]} feature rows for {batch.input_ids.shape[0]} query tokens")
        if self.threads is not None:
            self.threads.apply(batch.input_ids.shape[0])
        return self.head(
            batch.input_ids, features, batch.positions, batch.meta, self.kv_cache, batch.logits_indices
        )
