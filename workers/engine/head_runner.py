"""Runs an EAGLE head (workers/models/eagle_head.py) over its own one-layer paged KV cache.

The head's cache has the target's block ids (BlockManager): row t of a sequence lives in the slot of
position t of its block table. Inputs are ForwardItems like the target's, plus one feature row per query
token, flat in the same order. Its dense path compiles at start-up like a model's (workers/engine/compilation.py:
`new_compiled`, `forward_with`, the same shape buckets), and runs compiled where compile_stats says so.
"""

import time
from collections.abc import Callable

import torch

from workers.engine.compile_stats import Bucket, CompileStats, run_compiled_or_eager
from workers.engine.model_runner import (
    ForwardBatch,
    ForwardItem,
    PassGraphs,
    ShapesRun,
    ThreadPolicy,
    build_batch,
    flat_rows,
    report_pass,
)
from workers.models import fused_decode
from workers.models.compiled import CompiledHead
from workers.models.device import to_host
from workers.models.eagle_head import EagleHead
from workers.models.llama import eager_attend
from workers.models.native_attention import NativeAttention
from workers.spec.pass_costs import PassTiming


class HeadRunner:
    def __init__(self, head: EagleHead, num_blocks: int, block_size: int, threads: ThreadPolicy | None = None) -> None:
        self.head = head
        self.threads = threads
        self.block_size = block_size
        dtype, self.device = head.fc.weight.dtype, head.fc.weight.device
        shape = head.kv_cache_shape(num_blocks, block_size)
        self.kv_cache = (
            torch.zeros(shape, dtype=dtype, device=self.device), torch.zeros(shape, dtype=dtype, device=self.device)
        )
        # called after every pass with its timing: the speculator's cost table for the head
        self.on_pass: Callable[[PassTiming], None] | None = None
        self.shapes_run = ShapesRun()  # the sizes of every pass run so far
        self.native: NativeAttention | None = None  # the attention kernel, where it serves (use_native)
        self.compiled: CompiledHead | None = None
        self.compile_stats = CompileStats()
        self.graphs: PassGraphs | None = None  # chain passes replayed from CUDA graphs (decode_graphs.py)
        # the layer as one native call (workers/models/fused_decode.py), for passes of at most fused_max_tokens
        # tokens (workers/engine/fusing.py decides at start-up)
        self.fused: fused_decode.FusedLayers | None = None
        self.fused_max_tokens = 0

    @property
    def kv_caches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The one layer's (k, v) cache, as a model runner's per-layer list."""
        return [self.kv_cache]

    def use_native(self, native: NativeAttention | None) -> None:
        """Attend through the native kernel from now on (where it takes the head's dtype), or SDPA for None."""
        weight = self.head.fc.weight
        is_served = native is not None and weight.device.type == "cpu" and native.supports(weight.dtype)
        self.native = native if is_served else None

    @staticmethod
    def kv_bytes_per_block(head: EagleHead, block_size: int) -> int:
        cfg = head.cfg
        return 2 * block_size * cfg.num_kv_heads * cfg.head_dim * head.fc.weight.element_size()

    def forward(
        self,
        items: list[ForwardItem],
        features: torch.Tensor,  # [T, hidden]: one row per query token, items back to back
    ) -> tuple[torch.Tensor, torch.Tensor]:  # ([S, V] float32 logits, [S, hidden] h of the same rows)
        """One pass: compiled where compile_stats says so, else eager (run_compiled_or_eager)."""
        start_s = time.perf_counter()
        num_tokens = sum(len(it.token_ids) for it in items)
        if features.shape[0] != num_tokens:
            raise ValueError(f"{features.shape[0]} feature rows for {num_tokens} query tokens")
        out = self._run_graphed(items, features) if self.graphs is not None else None
        if out is None:  # not a pass a captured graph serves: built and dispatched op by op
            batch = build_batch(items, self.block_size, self.head.layer_cfg.sliding_window, self.native)
            if self.fused is not None and num_tokens <= self.fused_max_tokens and batch.meta.native is not None:
                out = self._run_fused(batch, features, self.fused)
            else:
                out = run_compiled_or_eager(
                    self.compile_stats, self.bucket_of(num_tokens), self.compiled,
                    lambda compiled: self._run(batch, features, compiled), f"head pass of {num_tokens} tokens",
                )
        report_pass(self.shapes_run, self.on_pass, items, out[0].shape[0], time.perf_counter() - start_s)
        return out

    def _run_graphed(
        self, items: list[ForwardItem], features: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor] | None:  # ([S, V] float32 logits, [S, hidden]), or None: not served
        assert self.graphs is not None
        out = self.graphs.run(items, True, features)
        if out is None:
            return None
        logits, h = out  # on the device; h: [T, hidden], every query token's
        assert h is not None
        rows = flat_rows(items)[1]  # h of the logits rows, as the dynamic pass
        return to_host(logits), h if len(rows) == h.shape[0] else h[rows]  # the proposer reads logits on the host

    def bucket_of(self, num_tokens: int) -> Bucket:
        return Bucket.of(num_tokens, self.threads.single_thread_max_tokens if self.threads is not None else 1)

    def new_compiled(self) -> CompiledHead:
        """The head's dense path under torch.compile, not yet compiled (workers/engine/compilation.py)."""
        return CompiledHead(self.head, self.kv_cache)

    def forward_with(self, items: list[ForwardItem], compiled: CompiledHead | None) -> torch.Tensor:  # [S, V]
        """A pass over zero features through `compiled` (it compiles a new shape bucket if needed), or eager
        for None: start-up compilation and its timing."""
        batch = build_batch(items, self.block_size, self.head.layer_cfg.sliding_window, self.native)
        return self._run(batch, self._zero_features(items), compiled)[0]

    def bind_fused(self) -> fused_decode.FusedLayers | None:
        """The head's layer bound to the native kernel's library, or None where it can't run there."""
        if self.native is None or not fused_decode.supports(self.head.fc.weight, self.native):
            return None
        return fused_decode.for_head(self.head, self.kv_cache, self.native)

    def probe_forward(self, items: list[ForwardItem]) -> torch.Tensor:  # [S, V] float32 logits
        """A pass over zero features, for start-up timing (workers/engine/cost_probe.py, packing.py, fusing.py)."""
        return self.forward(items, self._zero_features(items))[0]

    def _zero_features(self, items: list[ForwardItem]) -> torch.Tensor:  # [T, hidden]
        num_tokens = sum(len(it.token_ids) for it in items)
        return torch.zeros(num_tokens, self.head.cfg.hidden_size, dtype=self.head.fc.weight.dtype, device=self.device)

    @torch.inference_mode()
    def _run(
        self, batch: ForwardBatch, features: torch.Tensor, compiled: CompiledHead | None
    ) -> tuple[torch.Tensor, torch.Tensor]:  # ([S, V] float32 logits, [S, hidden] h of those rows)
        if self.threads is not None:
            self.threads.apply(batch.input_ids.shape[0])
        batch, features = batch.to(self.device), features.to(self.device)
        head = self.head
        if compiled is not None:
            h = compiled.hidden(batch.input_ids, features, batch.positions, batch.meta)  # [T, hidden]
        else:
            attend = eager_attend(batch.meta, self.kv_cache[0], self.kv_cache[1], head.attn_scale)
            h = head.hidden(batch.input_ids, features, batch.positions, attend)  # [T, hidden]
        h = h.index_select(0, batch.logits_indices)  # [S, hidden]
        return to_host(head.logits(h)), h

    def _run_fused(
        self, batch: ForwardBatch, features: torch.Tensor, fused: fused_decode.FusedLayers
    ) -> tuple[torch.Tensor, torch.Tensor]:  # ([S, V] float32 logits, [S, hidden] h of those rows)
        # no inference_mode, as ModelRunner._run_fused: the head's weights need no grad either
        if self.threads is not None:
            self.threads.apply(batch.input_ids.shape[0])
        if fused.first is not None:  # [T, hidden]: the layer's input (fc), then its output
            x = fused.first.run(self.head.fc_input(batch.input_ids, features))
        else:
            x = self.head.layer_input(batch.input_ids, features)
        fused.run(x, batch.positions, batch.meta)
        h = x.index_select(0, batch.logits_indices)  # [S, hidden]
        if fused.logits is not None:
            return self.head.widen(fused.logits.run(x, batch.logits_indices)), h
        return self.head.logits(h), h
