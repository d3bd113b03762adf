"""Decode passes replayed from CUDA graphs: captured once per (batch, context) bucket at start-up, then each
decode pass (one query token per sequence, no token tree: the target's and the draft's plain decode steps, the
EAGLE head's chain steps) copies its inputs into static buffers and replays its bucket's graph: one launch for
the whole pass, where op by op a small model's step is all dispatch. vLLM and nano-vllm capture decode graphs
over a ladder of batch sizes the same way.

A graph fixes every shape, so each captured pass is static:
- rows past the pass's sequences (a bucket of 8 for 5 sequences) are padding: token 0 at position 0, writing
  its K/V into the scratch block (one block past the block manager's, never handed to a sequence) and seeing
  that block's first key alone;
- attention is the SDPA path's gather through the block tables (workers/models/attention.py), over a width of
  blocks that the bucket fixes too: each row's table is padded with the scratch block to that width, and keys
  past the row's own end are masked out, as the dynamic path masks them. Widths double from
  MIN_BLOCKS_BUCKET, so a pass gathers at most twice the keys its longest sequence has (or that many blocks).

Passes no graph serves (prefill chunks, verify passes, trees, more rows or blocks than the largest bucket) run
op by op as before. With `capture=False` (the CPU) the same static pass runs op by op: the tests hold it to
the dynamic path's tokens, so what a GPU replays is what the CPU tests check.
"""

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from workers.engine.head_runner import HeadRunner
from workers.engine.model_runner import ForwardItem, ModelRunner, decode_columns
from workers.models.attention import AttentionMetadata
from workers.models.eagle_head import EagleHead
from workers.models.llama import LlamaModel, eager_attend

log = logging.getLogger(__name__)

MIN_BLOCKS_BUCKET = 8  # the narrowest context a graph spans, in blocks
NUM_COLUMNS = 5  # per row: token id, rotary position, KV slot, first key, one past the last key


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8, up to and including max_batch."""
    sizes = [n for n in (1, 2, 4) if n < max_batch] + list(range(8, max_batch, 8))
    return [*sizes, max_batch]


def block_buckets(max_blocks: int) -> list[int]:
    """MIN_BLOCKS_BUCKET, doubling, up to and including max_blocks."""
    widths: list[int] = []
    width = MIN_BLOCKS_BUCKET
    while width < max_blocks:
        widths.append(width)
        width *= 2
    return [*widths, max_blocks]


@dataclass(frozen=True)
class GraphBucket:
    batch: int  # rows: the pass's sequences, then padding
    num_blocks: int  # block-table width: each row may see keys [0, num_blocks * block_size)


# one static pass's dense work: (token ids [b], positions [b], attention metadata, features [b, hidden] or None)
# -> (logits [b, V] float32, h [b, hidden]); it writes the pass's K/V into its caches through the metadata
DenseBody = Callable[
    [torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor | None], tuple[torch.Tensor, torch.Tensor]
]


def model_body(model: LlamaModel, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> DenseBody:
    """A target's or a draft model's pass: every layer over its cache, logits of every row."""

    def body(
        ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, features: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        attends = [eager_attend(meta, k, v, model.attn_scale) for k, v in kv_caches]
        h = model.hidden_states(ids, positions, attends)  # [b, hidden]
        rows = torch.arange(h.shape[0], device=h.device)  # [b]: captured as a kernel, like the rest
        return model.logits(h, rows), h

    return body


def head_body(head: EagleHead, kv_cache: tuple[torch.Tensor, torch.Tensor]) -> DenseBody:
    """An EAGLE head's pass over its one-layer cache, reading each row's feature."""

    def body(
        ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, features: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        assert features is not None, "a head's pass reads features"
        attend = eager_attend(meta, kv_cache[0], kv_cache[1], head.attn_scale)
        h = head.hidden(ids, features, positions, attend)  # [b, hidden]
        return head.logits(h), h

    return body


def is_plain_decode(items: list[ForwardItem]) -> bool:
    """One query token per sequence, no token tree: the passes a graph serves."""
    return bool(items) and all(len(it.token_ids) == 1 and it.tree_mask is None for it in items)


@dataclass(frozen=True)
class GraphShape:
    """What a runner's graphs hold: the rows, block-table width and feature width of the largest bucket."""

    block_size: int
    scratch_block: int  # a cache block no sequence is given: padding rows write and read it
    max_batch: int
    max_blocks: int
    sliding_window: int | None = None  # the model's (the runner sets it)
    feature_size: int = 0  # > 0: each row reads a feature of this width (an EAGLE head; the runner sets it)


class DecodeGraphs:
    """One runner's decode graphs: its dense body, static inputs and outputs per bucket."""

    def __init__(
        self,
        body: DenseBody,
        shape: GraphShape,
        device: torch.device,
        dtype: torch.dtype,  # the features' (the head's weights')
        capture: bool,  # False: run the static pass op by op (the CPU; tests)
    ) -> None:
        self.body, self.capture = body, capture
        max_batch, max_blocks = shape.max_batch, shape.max_blocks
        block_size, scratch_block = self.block_size, self.scratch_block = shape.block_size, shape.scratch_block
        self.sliding_window = shape.sliding_window
        self.features = (
            torch.zeros(max_batch, shape.feature_size, dtype=dtype, device=device) if shape.feature_size else None
        )  # [B_max, hidden]
        self.columns = torch.zeros(NUM_COLUMNS, max_batch, dtype=torch.long, device=device)  # [5, B_max]
        self.tables = torch.full(
            (max_batch, max_blocks), scratch_block, dtype=torch.long, device=device
        )  # [B_max, NB_max]
        self.key_positions = torch.arange(max_blocks * block_size, device=device)  # [L_max]
        pad = [0, 0, scratch_block * block_size, 0, 1]  # token 0 at position 0, its K/V in the scratch slot
        self.pad_column = torch.tensor(pad, dtype=torch.long, device=device).view(NUM_COLUMNS, 1)  # [5, 1]
        self.batch_sizes, self.block_widths = batch_buckets(max_batch), block_buckets(max_blocks)
        self.graphs: dict[GraphBucket, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[GraphBucket, tuple[torch.Tensor, torch.Tensor]] = {}  # ([b, V] logits, [b, hidden] h)
        # every graph writes its outputs into these ([B_max, V], [B_max, hidden]; made by the first pass, before
        # any capture): one pair for all buckets, where each graph's own would hold [b, V] per bucket
        self.logits_out: torch.Tensor | None = None
        self.h_out: torch.Tensor | None = None
        self.capture_time_s = 0.0
        self.num_passes = 0  # passes served so far

    @property
    def buckets(self) -> list[GraphBucket]:
        return [GraphBucket(b, nb) for b in self.batch_sizes for nb in self.block_widths]

    def bucket_for(self, num_seqs: int, num_blocks: int) -> GraphBucket | None:
        """The smallest bucket holding `num_seqs` rows of `num_blocks` blocks each; None where none does."""
        batch = next((b for b in self.batch_sizes if b >= num_seqs), None)
        width = next((nb for nb in self.block_widths if nb >= num_blocks), None)
        return GraphBucket(batch, width) if batch is not None and width is not None else None

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Capture every bucket's graph, the largest first (the smaller ones reuse its pool's memory). Each is
        run once on a side stream before its capture, so lazy set-up (cuBLAS workspaces) happens outside it."""
        start_s = time.perf_counter()
        self._load_padding(self.columns.shape[1], self.tables.shape[1])
        pool = torch.cuda.graph_pool_handle()
        for bucket in sorted(self.buckets, key=lambda b: b.batch * b.num_blocks, reverse=True):
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self._pass(bucket)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[bucket] = self._pass(bucket)
            self.graphs[bucket] = graph
        torch.cuda.synchronize()
        self.capture_time_s = time.perf_counter() - start_s
        log.info("captured %d decode graphs (batch %s x blocks %s) in %.2f s", len(self.graphs),
                 self.batch_sizes, self.block_widths, self.capture_time_s)

    @torch.inference_mode()
    def run(
        self, items: list[ForwardItem], with_features: bool, features: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None] | None:  # ([S, V] float32 on the host, [B, hidden] or None)
        """The pass through its bucket's graph, or None where no graph serves it (the caller runs it op by
        op). `features` ([B, hidden], a head's) are its rows' inputs. Logits come back for the items that want
        them, in item order; h (`with_features`) for every item."""
        if not is_plain_decode(items):
            return None
        bucket = self.bucket_for(len(items), max(it.start_pos // self.block_size + 1 for it in items))
        if bucket is None:
            return None
        self._load(items, bucket, features)
        self.num_passes += 1
        if self.capture:
            self.graphs[bucket].replay()
            logits, h = self.outputs[bucket]
        else:
            logits, h = self._pass(bucket)
        num_seqs = len(items)
        host_logits = logits[:num_seqs].to("cpu", copy=True)  # [B, V]: the shared buffer is rewritten next pass
        rows = [i for i, it in enumerate(items) if it.num_logits]
        if len(rows) < num_seqs:
            host_logits = host_logits[rows]
        # the graph's output buffer is overwritten by its next replay: features outlive the pass
        return host_logits, h[:num_seqs].clone() if with_features else None

    def _load(self, items: list[ForwardItem], bucket: GraphBucket, features: torch.Tensor | None) -> None:
        """Copy the pass's rows into the static inputs, padding rows after them up to the bucket."""
        num_seqs, width = len(items), bucket.num_blocks
        if self.features is not None:
            assert features is not None and features.shape[0] == num_seqs, "one feature row per sequence"
            self.features[:num_seqs].copy_(features)  # padding rows keep whatever they held: their output is unused
        columns = torch.tensor(decode_columns(items, self.block_size, self.sliding_window), dtype=torch.long)  # [5, B]
        tables = [it.block_table[:width] + [self.scratch_block] * (width - len(it.block_table[:width])) for it in items]
        self.columns[:, :num_seqs].copy_(columns)
        self.tables[:num_seqs, :width].copy_(torch.tensor(tables, dtype=torch.long))  # [B, NB]
        self._load_padding(bucket.batch, width, num_seqs)

    def _load_padding(self, batch: int, width: int, first_row: int = 0) -> None:
        if first_row < batch:
            self.columns[:, first_row:batch].copy_(self.pad_column.expand(NUM_COLUMNS, batch - first_row))
            self.tables[first_row:batch, :width].fill_(self.scratch_block)

    def _pass(self, bucket: GraphBucket) -> tuple[torch.Tensor, torch.Tensor]:  # ([b, V] float32, [b, hidden])
        """The static pass of one bucket, over the static inputs: what a graph captures."""
        batch, width = bucket.batch, bucket.num_blocks
        ids, positions, slots, key_start, key_end = self.columns[:, :batch]  # [b] each
        keys = self.key_positions[: width * self.block_size]  # [L]
        mask = (keys >= key_start.unsqueeze(1)) & (keys < key_end.unsqueeze(1))  # [b, L]
        meta = AttentionMetadata(
            slot_mapping=slots,
            block_tables=self.tables[:batch, :width],  # [b, NB]
            mask=mask.view(batch, 1, 1, -1),  # [b, 1, Q=1, L]
            query_index=None,
            flat_index=None,
        )
        features = self.features[:batch] if self.features is not None else None  # [b, hidden]
        logits, h = self.body(ids, positions, meta, features)  # [b, V], [b, hidden]
        if self.logits_out is None or self.h_out is None:  # the first pass: never inside a capture
            max_batch = self.columns.shape[1]
            self.logits_out = logits.new_empty(max_batch, logits.shape[1])  # [B_max, V]
            self.h_out = h.new_empty(max_batch, h.shape[1])  # [B_max, hidden]
        self.logits_out[:batch].copy_(logits)
        self.h_out[:batch].copy_(h)
        return self.logits_out[:batch], self.h_out[:batch]


def graphs_for(runner: ModelRunner | HeadRunner, shape: GraphShape, capture: bool) -> DecodeGraphs:
    """Decode graphs over a runner's model (or EAGLE head) and caches, not captured yet: `shape` with the
    model's sliding window, and a head's feature width."""
    if isinstance(runner, HeadRunner):
        head, weight = runner.head, runner.head.fc.weight
        shape = dataclasses.replace(
            shape, sliding_window=head.layer_cfg.sliding_window, feature_size=head.cfg.hidden_size
        )
        return DecodeGraphs(head_body(head, runner.kv_cache), shape, weight.device, weight.dtype, capture)
    model, weight = runner.model, runner.model.embed.weight
    shape = dataclasses.replace(shape, sliding_window=model.cfg.sliding_window)
    return DecodeGraphs(model_body(model, runner.kv_caches), shape, weight.device, weight.dtype, capture)
