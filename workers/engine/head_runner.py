"""Runs an EAGLE head (workers/models/eagle_head.py) over its own one-layer paged KV cache.

The head's cache has the target's block ids (BlockManager): row t of a sequence lives in the slot of
position t of its block table. Inputs are ForwardItems like the target's, plus one feature row per query
token, flat in the same order.
"""

import time
from collections.abc import Callable

import torch

from workers.engine.model_runner import ForwardItem, ThreadPolicy, build_batch, report_pass
from workers.models.eagle_head import EagleHead
from workers.models.native_attention import NativeAttention
from workers.spec.pass_costs import PassTiming


class HeadRunner:
    def __init__(self, head: EagleHead, num_blocks: int, block_size: int, threads: ThreadPolicy | None = None) -> None:
        self.head = head
        self.threads = threads
        self.block_size = block_size
        dtype = head.fc.weight.dtype
        shape = head.kv_cache_shape(num_blocks, block_size)
        self.kv_cache = (torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))
        # called after every pass with its timing: the speculator's cost table for the head
        self.on_pass: Callable[[PassTiming], None] | None = None
        self.shapes_run: set[tuple[int, int]] = set()  # (tokens, logits rows) of every pass run so far
        self.native: NativeAttention | None = None  # the attention kernel, where it serves (use_native)

    def use_native(self, native: NativeAttention | None) -> None:
        """Attend through the native kernel from now on (where it takes the head's dtype), or SDPA for None."""
        self.native = native if native is not None and native.supports(self.head.fc.weight.dtype) else None

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
        start_s = time.perf_counter()
        batch = build_batch(items, self.block_size, self.head.layer_cfg.sliding_window, self.native)
        num_tokens = batch.input_ids.shape[0]
        if features.shape[0] != num_tokens:
            raise ValueError(f"{features.shape[0]} feature rows for {num_tokens} query tokens")
        if self.threads is not None:
            self.threads.apply(num_tokens)
        out = self.head(batch.input_ids, features, batch.positions, batch.meta, self.kv_cache, batch.logits_indices)
        report_pass(self.shapes_run, self.on_pass, items, batch, time.perf_counter() - start_s)
        return out

    def probe_forward(self, items: list[ForwardItem]) -> torch.Tensor:  # [S, V] float32 logits
        """A pass over zero features, for start-up timing (workers/engine/cost_probe.py, packing.py)."""
        num_tokens = sum(len(it.token_ids) for it in items)
        zeros = torch.zeros(num_tokens, self.head.cfg.hidden_size, dtype=self.head.fc.weight.dtype)  # [T, hidden]
        return self.forward(items, zeros)[0]
