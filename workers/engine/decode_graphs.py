"""Decode passes replayed from CUDA graphs: captured once per (batch, queries, context) bucket at start-up,
then each pass of a few query tokens per sequence (the target's and the draft's plain decode steps, the EAGLE
head's chain steps; with speculation, the target's verify passes of 1 + k tokens per sequence, chains or token
trees, and the draft's and the head's catch-up and tree-level passes) copies its inputs into static buffers
and replays its bucket's graph: one launch for the whole pass, where op by op a small model's step is all
dispatch. vLLM and nano-vllm capture decode graphs over a ladder of batch sizes the same way; vLLM captures
its speculative decoding's uniform verify batches (1 + k queries per sequence) too.

A graph fixes every shape, so each captured pass is static:
- each sequence is a row of the bucket's `num_queries` tokens, flat row after row ([batch * num_queries]);
  tokens past a sequence's own (3 tokens in a row of 5) and rows past the pass's sequences (a bucket of 8 for
  5 sequences) are padding: token 0 at position 0, writing its K/V into the scratch block (one block past the
  block manager's, never handed to a sequence) and seeing its row's first key alone;
- attention is the SDPA path's gather through the block tables (workers/models/attention.py), over a width of
  blocks that the bucket fixes too: each row's table is padded with the scratch block to that width, and each
  token sees the keys the dynamic path's mask lets it see: a range [first key, one past the last) of its
  sequence, and in a token tree the tree slots its mask row names (tree_base + j for each bit j of tree_bits,
  as the native kernel reads them: workers/engine/model_runner.py, add_token_view). Widths double from
  MIN_BLOCKS_BUCKET, so a pass gathers at most twice the keys its longest sequence has (or that many blocks).

Passes no graph serves (prefill chunks longer than the longest row, trees of more than MAX_TREE_NODES slots,
more rows or blocks than the largest bucket) run op by op as before. With `capture=False` (the CPU) the same
static pass runs op by op: the tests hold it to the dynamic path's tokens, so what a GPU replays is what the
CPU tests check.
"""

import dataclasses
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch

from workers.engine.head_runner import HeadRunner
from workers.engine.model_runner import (
    ForwardItem,
    ModelRunner,
    add_token_view,
    decode_columns,
    flat_rows,
    tree_fits,
    window_starts,
)
from workers.models.attention import AttentionMetadata
from workers.models.eagle_head import EagleHead
from workers.models.llama import LlamaModel, eager_attend
from workers.models.native_attention import MAX_TREE_NODES

log = logging.getLogger(__name__)

MIN_BLOCKS_BUCKET = 8  # the narrowest context a graph spans, in blocks
# per query token: token id, rotary position, KV slot, first key, one past the last key (the range it sees), then
# in a token tree the first tree slot and the bits of the tree slots it sees (else 0, 0)
NUM_COLUMNS = 7


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8, up to and including max_batch."""
    sizes = [n for n in (1, 2, 4) if n < max_batch] + list(range(8, max_batch, 8))
    return [*sizes, max_batch]


def query_buckets(max_queries: int) -> list[int]:
    """Query tokens per sequence: 1 (decode), then 1 + k for k = 1, 2, 4, 8, ... draft tokens, up to and
    including max_queries (1 + the longest chain a step speculates)."""
    sizes: list[int] = []
    num_drafts = 0
    while 1 + num_drafts < max_queries:
        sizes.append(1 + num_drafts)
        num_drafts = max(1, 2 * num_drafts)
    return [*sizes, max_queries]


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
    num_queries: int = 1  # query tokens per row: a sequence's, then padding

    @property
    def num_tokens(self) -> int:
        return self.batch * self.num_queries


# one static pass's dense work: (token ids [n], positions [n], attention metadata, features [n, hidden] or None)
# -> (logits [n, V] float32, h [n, hidden]), n = batch x queries; it writes the pass's K/V into its caches
# through the metadata
DenseBody = Callable[
    [torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor | None], tuple[torch.Tensor, torch.Tensor]
]


def model_body(model: LlamaModel, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> DenseBody:
    """A target's or a draft model's pass: every layer over its cache, logits of every row."""

    def body(
        ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, features: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        attends = [eager_attend(meta, k, v, model.attn_scale) for k, v in kv_caches]
        h = model.hidden_states(ids, positions, attends)  # [n, hidden]
        rows = torch.arange(h.shape[0], device=h.device)  # [n]: captured as a kernel, like the rest
        return model.logits(h, rows), h

    return body


def head_body(head: EagleHead, kv_cache: tuple[torch.Tensor, torch.Tensor]) -> DenseBody:
    """An EAGLE head's pass over its one-layer cache, reading each row's feature."""

    def body(
        ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, features: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        assert features is not None, "a head's pass reads features"
        attend = eager_attend(meta, kv_cache[0], kv_cache[1], head.attn_scale)
        h = head.hidden(ids, features, positions, attend)  # [n, hidden]
        return head.logits(h), h

    return body


def max_row_queries(items: list[ForwardItem]) -> int:
    """The most query tokens of a sequence in the pass (a graph's row must hold them); 0 where a graph cannot
    serve the pass (it is empty, or a tree's slots do not fit a bitmask)."""
    if not items or not all(tree_fits(it) for it in items):
        return 0
    return max(len(it.token_ids) for it in items)


def query_columns(
    items: list[ForwardItem], num_queries: int, block_size: int, sliding_window: int | None, pad: list[int]
) -> list[list[int]]:
    """A pass's seven integers per query token (NUM_COLUMNS: add_token_view's, the own ends turned into first
    keys), each sequence padded with `pad` to `num_queries` tokens: [7][len(items) * num_queries]."""
    columns: list[list[int]] = [[] for _ in range(NUM_COLUMNS)]
    own_end_pad = [*pad[:3], pad[4], *pad[4:]]  # a padding token's own end is its key end (slot 0 + 1)
    for it in items:
        add_token_view(columns, it, block_size)
        for column, value in zip(columns, own_end_pad, strict=True):
            column.extend([value] * (num_queries - len(it.token_ids)))
    columns[3] = window_starts(columns[3], sliding_window)  # padding: window_starts([1]) = [0], its first key
    return columns


@dataclass(frozen=True)
class GraphShape:
    """What a runner's graphs hold: the rows, block-table width and feature width of the largest bucket."""

    block_size: int
    scratch_block: int  # a cache block no sequence is given: padding rows write and read it
    max_batch: int
    max_blocks: int
    max_queries: int = 1  # query tokens per sequence of the longest row (1 + k with speculation)
    max_tokens: int | None = None  # no bucket of more rows x queries than this (the scheduler's token budget)
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
        self.body, self.capture, self.device = body, capture, device
        max_batch, max_blocks = shape.max_batch, shape.max_blocks
        block_size, scratch_block = self.block_size, self.scratch_block = shape.block_size, shape.scratch_block
        self.sliding_window = shape.sliding_window
        self.batch_sizes, self.block_widths = batch_buckets(max_batch), block_buckets(max_blocks)
        self.query_sizes = query_buckets(shape.max_queries)
        self.max_tokens = shape.max_tokens
        self.buckets = [
            GraphBucket(b, nb, q)
            for q in self.query_sizes for b in self.batch_sizes for nb in self.block_widths
            if self.max_tokens is None or b * q <= self.max_tokens
        ]
        max_rows = max(b.num_tokens for b in self.buckets)  # N_max: the largest bucket's query tokens
        self.features = (
            torch.zeros(max_rows, shape.feature_size, dtype=dtype, device=device) if shape.feature_size else None
        )  # [N_max, hidden]
        self.columns = torch.zeros(NUM_COLUMNS, max_rows, dtype=torch.long, device=device)  # [7, N_max]
        self.tables = torch.full(
            (max_batch, max_blocks), scratch_block, dtype=torch.long, device=device
        )  # [B_max, NB_max]
        self.key_positions = torch.arange(max_blocks * block_size, device=device)  # [L_max]
        self.pad = [0, 0, scratch_block * block_size, 0, 1, 0, 0]  # token 0 at position 0, K/V in the scratch slot
        self.pad_column = torch.tensor(self.pad, dtype=torch.long, device=device).view(NUM_COLUMNS, 1)  # [7, 1]
        self.graphs: dict[GraphBucket, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[GraphBucket, tuple[torch.Tensor, torch.Tensor]] = {}  # ([n, V] logits, [n, hidden] h)
        # every graph writes its outputs into these ([N_max, V], [N_max, hidden]; made by the first pass, before
        # any capture): one pair for all buckets, where each graph's own would hold [n, V] per bucket
        self.logits_out: torch.Tensor | None = None
        self.h_out: torch.Tensor | None = None
        self.capture_time_s = 0.0
        self.num_passes = 0  # passes served so far
        self.num_passes_by_queries: Counter[int] = Counter()  # the same, by their bucket's query tokens per row

    def bucket_for(self, num_seqs: int, num_blocks: int, num_queries: int = 1) -> GraphBucket | None:
        """The smallest bucket holding `num_seqs` rows of `num_queries` tokens and `num_blocks` blocks each; None
        where none does."""
        batch = next((b for b in self.batch_sizes if b >= num_seqs), None)
        width = next((nb for nb in self.block_widths if nb >= num_blocks), None)
        queries = next((q for q in self.query_sizes if q >= num_queries), None)
        if batch is None or width is None or queries is None:
            return None
        if self.max_tokens is not None and batch * queries > self.max_tokens:
            return None  # over the token budget: no such graph
        return GraphBucket(batch, width, queries)

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Capture every bucket's graph, the largest first (the smaller ones reuse its pool's memory). Each is
        run once on a side stream before its capture, so lazy set-up (cuBLAS workspaces) happens outside it."""
        start_s = time.perf_counter()
        self.columns.copy_(self.pad_column.expand_as(self.columns))  # every token padding until a pass loads
        self.tables.fill_(self.scratch_block)
        pool = torch.cuda.graph_pool_handle()
        for bucket in sorted(self.buckets, key=lambda b: b.num_tokens * b.num_blocks, reverse=True):
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
        log.info("captured %d decode graphs (batch %s x blocks %s x queries %s) in %.2f s", len(self.graphs),
                 self.batch_sizes, self.block_widths, self.query_sizes, self.capture_time_s)

    @torch.inference_mode()
    def run(
        self, items: list[ForwardItem], with_features: bool, features: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None] | None:  # ([S, V] float32, [T, hidden] or None) on the device
        """The pass through its bucket's graph, or None where no graph serves it (the caller runs it op by
        op). `features` ([T, hidden], a head's) are its query tokens' inputs. Logits come back for each item's
        last num_logits tokens, in item order; h (`with_features`) for every query token, flat in item order."""
        num_queries = max_row_queries(items)
        if num_queries == 0:
            return None
        num_blocks = max(-(-(it.start_pos + len(it.token_ids)) // self.block_size) for it in items)
        bucket = self.bucket_for(len(items), num_blocks, num_queries)
        if bucket is None:
            return None
        self._load(items, bucket, features)
        self.num_passes += 1
        self.num_passes_by_queries[bucket.num_queries] += 1
        if self.capture:
            self.graphs[bucket].replay()
            logits, h = self.outputs[bucket]
        else:
            logits, h = self._pass(bucket)
        # the graph's output buffers are overwritten by its next replay: what a pass returns is a copy, on the
        # device (the engine copies logits to the host only where it reads more than their argmax)
        if bucket.num_queries == 1:  # a decode pass: row i is item i
            num_seqs = len(items)
            rows = [i for i, it in enumerate(items) if it.num_logits]
            out = logits[:num_seqs].clone() if len(rows) == num_seqs else logits.index_select(0, self._on_device(rows))
            return out, h[:num_seqs].clone() if with_features else None  # [S, V], [B, hidden]
        token_rows, logits_rows = flat_rows(items, bucket.num_queries)
        out = logits.index_select(0, self._on_device(logits_rows))  # [S, V]
        return out, h.index_select(0, self._on_device(token_rows)) if with_features else None  # [T, hidden]

    def _on_device(self, rows: list[int]) -> torch.Tensor:  # [n] long
        return torch.tensor(rows, dtype=torch.long).to(self.device, non_blocking=True)

    def _load(self, items: list[ForwardItem], bucket: GraphBucket, features: torch.Tensor | None) -> None:
        """Copy the pass's tokens into the static inputs, row by row, padding each row to the bucket's queries
        and the rows after them up to the bucket's."""
        num_seqs, width, num_queries = len(items), bucket.num_blocks, bucket.num_queries
        num_rows = num_seqs * num_queries  # query tokens of the pass's rows, padding included
        if self.features is not None:  # padding tokens keep whatever they held: their output is unused
            num_tokens = sum(len(it.token_ids) for it in items)
            assert features is not None and features.shape[0] == num_tokens, "one feature row per query token"
            if num_tokens == num_rows:
                self.features[:num_rows].copy_(features)
            else:
                rows = self._on_device(flat_rows(items, num_queries)[0])  # [T]
                self.features.index_copy_(0, rows, features.to(self.features.dtype))
        if num_queries == 1 and all(it.tree_mask is None for it in items):  # a decode pass: a token per sequence
            columns = [*decode_columns(items, self.block_size, self.sliding_window), [0] * num_seqs, [0] * num_seqs]
        else:
            columns = query_columns(items, num_queries, self.block_size, self.sliding_window, self.pad)
        tables = [it.block_table[:width] + [self.scratch_block] * (width - len(it.block_table[:width])) for it in items]
        self.columns[:, :num_rows].copy_(torch.tensor(columns, dtype=torch.long))  # [7, n]
        self.tables[:num_seqs, :width].copy_(torch.tensor(tables, dtype=torch.long))  # [B, NB]
        self._load_padding(bucket.batch, width, num_seqs, num_queries)

    def _load_padding(self, batch: int, width: int, first_row: int = 0, num_queries: int = 1) -> None:
        """Rows first_row..batch as padding: every token of theirs the pad column, their tables the scratch
        block."""
        if first_row < batch:
            first, last = first_row * num_queries, batch * num_queries
            self.columns[:, first:last].copy_(self.pad_column.expand(NUM_COLUMNS, last - first))
            self.tables[first_row:batch, :width].fill_(self.scratch_block)

    def _pass(self, bucket: GraphBucket) -> tuple[torch.Tensor, torch.Tensor]:  # ([n, V] float32, [n, hidden])
        """The static pass of one bucket, over the static inputs: what a graph captures."""
        batch, width, num_queries, num_rows = bucket.batch, bucket.num_blocks, bucket.num_queries, bucket.num_tokens
        ids, positions, slots, key_start, key_end, tree_base, bits = self.columns[:, :num_rows]  # [n] each
        keys = self.key_positions[: width * self.block_size]  # [L]
        mask = (keys >= key_start.unsqueeze(1)) & (keys < key_end.unsqueeze(1))  # [n, L]
        offset = keys - tree_base.unsqueeze(1)  # [n, L]: each key's slot in its token's tree (0 = the first)
        in_tree = (offset >= 0) & (offset < MAX_TREE_NODES)  # [n, L]
        seen = (bits.unsqueeze(1) >> offset.clamp(0, MAX_TREE_NODES - 1)) & 1  # [n, L]: bit `offset` of the row's
        mask |= in_tree & seen.bool()  # the tree slots the token sees (none where its bits are 0)
        meta = AttentionMetadata(
            slot_mapping=slots,
            block_tables=self.tables[:batch, :width],  # [b, NB]
            mask=mask.view(batch, 1, num_queries, -1),  # [b, 1, Q, L]: row b's queries are tokens b*Q .. b*Q+Q-1
            query_index=None,
            flat_index=None,
        )
        features = self.features[:num_rows] if self.features is not None else None  # [n, hidden]
        logits, h = self.body(ids, positions, meta, features)  # [n, V], [n, hidden]
        if self.logits_out is None or self.h_out is None:  # the first pass: never inside a capture
            max_rows = self.columns.shape[1]
            self.logits_out = logits.new_empty(max_rows, logits.shape[1])  # [N_max, V]
            self.h_out = h.new_empty(max_rows, h.shape[1])  # [N_max, hidden]
        self.logits_out[:num_rows].copy_(logits)
        self.h_out[:num_rows].copy_(h)
        return self.logits_out[:num_rows], self.h_out[:num_rows]


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
