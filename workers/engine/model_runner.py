"""Turns a scheduled batch into flat model inputs plus attention metadata, and runs one forward.

Every sequence contributes its query tokens back to back ([T] flat); the metadata tells attention where
each token's K/V goes (slot_mapping), which blocks each sequence reads (block_tables) and what each query
may see (mask: causal over the sequence's own keys, padding excluded).
"""

import array
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from workers.engine.compile_stats import Bucket, CompileStats, run_compiled_or_eager
from workers.models import fused_decode
from workers.models.attention import AttentionMetadata
from workers.models.compiled import CompiledModel
from workers.models.device import to_host
from workers.models.llama import LlamaModel, eager_attend
from workers.models.native_attention import MAX_TREE_NODES, NativeAttention
from workers.spec.pass_costs import AttentionWork, PassTiming, num_pairs


class PassGraphs(Protocol):
    """Passes a runner hands to captured graphs first (workers/engine/decode_graphs.py: DecodeGraphs)."""

    def run(
        self, items: list["ForwardItem"], with_features: bool, features: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None] | None:  # ([S, V] host logits, [T, hidden] or None); None: not served
        ...


@dataclass
class ForwardItem:
    """One sequence's share of a forward pass."""

    token_ids: list[int]  # [n] query tokens
    start_pos: int  # position (and KV slot index in the sequence) of the first query token
    block_table: list[int]  # the sequence's KV blocks, covering start_pos + n tokens
    num_logits: int  # logits wanted for the last `num_logits` query tokens (0 = none)
    # token trees (speculative decoding): query i sits in KV slot start_pos + i at rotary position
    # positions[i]; it sees every slot before tree_start and the tree slots tree_start + j with tree_mask[i, j]
    positions: list[int] | None = None  # [n]; None = start_pos + i
    tree_start: int = 0  # first KV slot of the tree's nodes
    tree_mask: torch.Tensor | None = None  # [n, m] bool over tree slots tree_start .. tree_start + m; None = causal


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] long
    positions: torch.Tensor  # [T] long
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # [S] long: flat rows whose logits are returned, in item order

    def to(self, device: torch.device) -> "ForwardBatch":
        """The batch on `device`: built on the CPU, it moves to a CUDA model's device before the pass."""
        if device.type == "cpu":
            return self
        return ForwardBatch(
            self.input_ids.to(device), self.positions.to(device), self.meta.to(device), self.logits_indices.to(device)
        )


def attention_work(items: list[ForwardItem]) -> AttentionWork:
    """The pass's attention over committed context, for its cost (workers/spec/pass_costs.py): each sequence's
    query rows over the tokens before its first one (AttentionWork.of_rows, summed)."""
    return AttentionWork(
        sum(item.start_pos for item in items),
        sum(num_pairs(len(item.token_ids), item.start_pos) for item in items),
    )


@dataclass
class ShapesRun:
    """The pass sizes a runner ran so far. oneDNN sets a matmul up once per shape (~3-4 ms a new token count on
    the demo target, as much on its one-layer draft as a pass takes), and keeps it in its primitive cache: the
    dense layers' shape is the pass's token count, the LM head's its logits rows."""

    tokens: set[int] = field(default_factory=set)
    logits_rows: set[int] = field(default_factory=set)

    def add(self, num_tokens: int, num_logits_rows: int) -> bool:
        """Record a pass; True when either of its sizes is new (its time holds a one-time set-up)."""
        is_new = num_tokens not in self.tokens or num_logits_rows not in self.logits_rows
        self.tokens.add(num_tokens)
        self.logits_rows.add(num_logits_rows)
        return is_new


def report_pass(
    shapes_run: ShapesRun,  # the sizes the runner ran before; this pass's are added
    on_pass: Callable[[PassTiming], None] | None,
    items: list[ForwardItem],
    num_logits_rows: int,
    seconds: float,
) -> None:
    """Record a runner's pass and hand its timing to `on_pass`: is it the runner's first of its shape."""
    num_tokens = sum(len(it.token_ids) for it in items)
    is_first = shapes_run.add(num_tokens, num_logits_rows)
    if on_pass is not None:
        on_pass(PassTiming(num_tokens, seconds, attention_work(items), is_first))


def flat_rows(items: list[ForwardItem], num_queries: int | None = None) -> tuple[list[int], list[int]]:
    """Where a pass's query tokens sit among its rows: ([T] each token's row, in item order; [S] the rows whose
    logits the pass returns: each item's last num_logits tokens). Items back to back, or (num_queries) each in
    a row of its own of that many tokens, padding after its own (a decode graph's bucket)."""
    token_rows: list[int] = []
    logits_rows: list[int] = []
    first = 0
    for it in items:
        n = len(it.token_ids)
        token_rows.extend(range(first, first + n))
        logits_rows.extend(range(first + n - it.num_logits, first + n))
        first += n if num_queries is None else num_queries
    return token_rows, logits_rows


def add_token_view(columns: list[list[int]], item: ForwardItem, block_size: int) -> None:
    """Append the item's query tokens to the per-token columns [token ids, rotary positions, KV slots, own ends
    (slot + 1), key ends, tree bases, tree bits]: each token sees its sequence's keys up to its key end (from
    the start of its window, window_starts over the own ends), and in a token tree the prefix before the tree
    causally, then the tree slots tree_base + j for each bit j of its tree bits (its mask row). The native
    kernel's ragged view and the decode graphs' static passes read these."""
    ids, positions, slots, own_end, key_end, tree_base, bits = columns
    n, start, table = len(item.token_ids), item.start_pos, item.block_table
    ids.extend(item.token_ids)
    positions.extend(item.positions or range(start, start + n))
    slots += [table[p // block_size] * block_size + p % block_size for p in range(start, start + n)]
    ends = range(start + 1, start + n + 1)
    own_end.extend(ends)
    if item.tree_mask is None:
        key_end.extend(ends)
        tree_base.extend([0] * n)
        bits.extend([0] * n)
    else:
        key_end.extend(min(end, item.tree_start) for end in ends)
        tree_base.extend([item.tree_start] * n)
        bits.extend(tree_bits(item.tree_mask[:n]))


def warm_items(num_tokens: int, block_size: int) -> list[ForwardItem]:
    """One pass of `num_tokens` tokens with as many logits rows, into blocks 0..: for warming a runner's
    shapes while no sequence holds a block (Engine.warm_pass_shapes)."""
    return [ForwardItem([0] * num_tokens, 0, list(range(-(-num_tokens // block_size))), num_logits=num_tokens)]


def build_batch(
    items: list[ForwardItem], block_size: int, sliding_window: int | None = None, native: NativeAttention | None = None
) -> ForwardBatch:
    """The pass's flat inputs and attention metadata. With `native` (the runner's kernel), a pass it can serve
    gets only the ragged view the kernel reads; otherwise the SDPA path's padded view too."""
    if native is not None and not _native_serves(items):
        native = None
    if all(len(it.token_ids) == 1 and it.tree_mask is None for it in items):
        return _build_decode_batch(items, block_size, sliding_window, native)
    return _build_ragged_batch(items, block_size, sliding_window, native)


def _native_serves(items: list[ForwardItem]) -> bool:
    """Whether the kernel's per-token view holds every query (tree_fits)."""
    return all(tree_fits(it) for it in items)


def tree_fits(item: ForwardItem) -> bool:
    """Whether a per-token view (first key, one past the last, tree bits) holds the item's queries: no
    tree, or a tree whose slots fit one bitmask, a mask row for every query, and no query past its tree (where
    it would see slots after the tree causally). The native kernel and the decode graphs read that view."""
    if item.tree_mask is None:
        return True
    num_rows, num_slots = item.tree_mask.shape
    num_tokens = len(item.token_ids)
    is_past_tree = item.start_pos + num_tokens > item.tree_start + num_slots
    return num_slots <= MAX_TREE_NODES and num_rows >= num_tokens and not is_past_tree


def _build_ragged_batch(
    items: list[ForwardItem], block_size: int, sliding_window: int | None, native: NativeAttention | None = None
) -> ForwardBatch:
    """Any mix of prefill chunks, decodes, drafts to verify and token trees."""
    token_columns: list[list[int]] = [[] for _ in range(7)]  # add_token_view's
    input_ids, positions, slots, own_end, key_end, tree_base, bits = token_columns
    token_seq: list[int] = []
    logits_rows: list[int] = []  # flat_rows(items)[1], in the same loop
    q_lens = [len(it.token_ids) for it in items]
    for b, it in enumerate(items):
        offset, n = len(input_ids), len(it.token_ids)
        add_token_view(token_columns, it, block_size)
        token_seq.extend([b] * n)
        logits_rows.extend(range(offset + n - it.num_logits, offset + n))

    num_blocks_max = max(-(-(it.start_pos + len(it.token_ids)) // block_size) for it in items)
    columns = [input_ids, positions, slots, logits_rows, _padded_tables(items, num_blocks_max)]
    has_ragged_view = native is not None or all(it.tree_mask is None for it in items)
    if has_ragged_view:  # the window ends at each token's own slot
        columns += [token_seq, window_starts(own_end, sliding_window), key_end, tree_base, bits]
    tensors = long_tensors(columns)  # [T], [T], [T], [S], [B * NB], then [T] each
    meta = AttentionMetadata(
        slot_mapping=tensors[2], block_tables=tensors[4].view(len(items), num_blocks_max), mask=None,
        query_index=None, flat_index=None, native=native,
    )
    if has_ragged_view:
        meta.token_seq, meta.key_start, meta.key_end, meta.tree_base, meta.tree_bits = tensors[5:]
    if native is None:
        _add_padded_view(meta, items, q_lens, block_size, sliding_window)
    return ForwardBatch(input_ids=tensors[0], positions=tensors[1], meta=meta, logits_indices=tensors[3])


def long_tensors(columns: list[list[int]]) -> tuple[torch.Tensor, ...]:
    """The lists as long tensors, each a view of one buffer: a pass's metadata is a dozen small tensors, and
    every torch call costs microseconds of dispatch whatever its size. The buffer is an int64 array filled in
    C and lent to torch as it is (torch.tensor over a list checks every element in Python's objects first:
    ~2x the time for a decode step's metadata, 1.7x for a 512-token prefill's)."""
    sizes = [len(column) for column in columns]
    flat = array.array("q", itertools.chain.from_iterable(columns))
    if not flat:  # frombuffer refuses an empty buffer
        return torch.empty(0, dtype=torch.long).split_with_sizes(sizes)
    return torch.frombuffer(flat, dtype=torch.long).split_with_sizes(sizes)  # the tensor keeps `flat` alive


def _padded_tables(items: list[ForwardItem], num_blocks: int) -> list[int]:  # [B * num_blocks]
    """Each sequence's first `num_blocks` blocks, padded with block 0, back to back."""
    flat: list[int] = []
    for it in items:
        table = it.block_table[:num_blocks]
        flat += table
        flat += [0] * (num_blocks - len(table))
    return flat


def tree_bits(tree_mask: torch.Tensor) -> list[int]:  # [n, m] bool -> [n]
    """Each query row's visible tree slots as one integer, bit j for slot tree_start + j (m <= MAX_TREE_NODES)."""
    rows = tree_mask.long()  # [n, m]
    return (rows << torch.arange(rows.shape[1])).sum(dim=1).tolist()


def window_starts(own_end: list[int], sliding_window: int | None) -> list[int]:
    """First key each token sees: 0, or the start of its sliding window (the `sliding_window` slots up to and
    including its own; own_end = its slot + 1)."""
    if sliding_window is None:
        return [0] * len(own_end)
    return [max(0, end - sliding_window) for end in own_end]


def _add_padded_view(
    meta: AttentionMetadata, items: list[ForwardItem], q_lens: list[int], block_size: int, sliding_window: int | None
) -> None:
    """The SDPA path's view: every sequence's queries padded to the longest, one mask over keys and queries."""
    batch, max_q = len(items), max(q_lens)
    num_keys = meta.block_tables.shape[1] * block_size
    is_uniform = all(n == max_q for n in q_lens)  # e.g. a pure decode step: no padded queries
    q_len_t = torch.tensor(q_lens)  # [B]
    q_idx = torch.arange(max_q).unsqueeze(0)  # [1, Q]
    q_pos = torch.tensor([it.start_pos for it in items]).unsqueeze(1) + q_idx  # [B, Q] slot positions
    key_pos = torch.arange(num_keys).view(1, 1, -1)  # [1, 1, L]
    mask = key_pos <= q_pos.unsqueeze(2)  # [B, Q, L] causal; keys past the sequence are never <= its queries
    if sliding_window is not None:
        mask &= key_pos > (q_pos.unsqueeze(2) - sliding_window)
    for b, it in enumerate(items):
        if it.tree_mask is not None:
            n, m = it.tree_mask.shape
            mask[b, :n, it.tree_start : it.tree_start + m] = it.tree_mask
    is_real_query = q_idx < q_len_t.unsqueeze(1)  # [B, Q]
    if not is_uniform:
        mask &= is_real_query.unsqueeze(2)
        mask[:, :, 0] |= ~is_real_query  # padded query rows look at one key so softmax stays finite
        starts = torch.tensor([0, *q_lens[:-1]]).cumsum(0).unsqueeze(1)  # [B, 1]
        last = (q_len_t - 1).unsqueeze(1)  # [B, 1]
        meta.query_index = starts + torch.minimum(q_idx, last)  # [B, Q]
        meta.flat_index = (torch.arange(batch).unsqueeze(1) * max_q + q_idx)[is_real_query]  # [T]
    meta.mask = mask.unsqueeze(1)  # [B, 1, Q, L]


def decode_columns(items: list[ForwardItem], block_size: int, sliding_window: int | None) -> list[list[int]]:
    """A decode pass's five integers per sequence (one query token each), as [5][B] lists: token id, rotary
    position, KV slot, first key it sees, one past its last key (its position + 1)."""
    key_end = [it.start_pos + 1 for it in items]
    return [
        [it.token_ids[0] for it in items],
        [it.positions[0] if it.positions else it.start_pos for it in items],
        [it.block_table[it.start_pos // block_size] * block_size + it.start_pos % block_size for it in items],
        window_starts(key_end, sliding_window),
        key_end,
    ]


def _build_decode_batch(
    items: list[ForwardItem], block_size: int, sliding_window: int | None, native: NativeAttention | None = None
) -> ForwardBatch:
    """The common step (plain decoding, each draft token): one query token per sequence, so nothing is
    padded and the metadata is a few integers per sequence, turned into tensors in one call."""
    batch = len(items)
    num_blocks_max = max(it.start_pos // block_size + 1 for it in items)
    logits_rows = [i for i, it in enumerate(items) if it.num_logits]
    columns = long_tensors([
        *decode_columns(items, block_size, sliding_window),
        list(range(batch)),
        [0] * batch,
        [0] * batch,
        logits_rows,
        _padded_tables(items, num_blocks_max),
    ])  # [B] each, [S], [B * NB]
    ids, positions, slots, key_start, key_end, token_seq, tree_base, tree_bits, logits_indices, tables = columns
    meta = AttentionMetadata(
        slot_mapping=slots,
        block_tables=tables.view(batch, num_blocks_max),
        mask=None,
        query_index=None,
        flat_index=None,
        token_seq=token_seq,
        key_start=key_start,
        key_end=key_end,
        tree_base=tree_base,
        tree_bits=tree_bits,
        native=native,
    )
    if native is None:
        q_pos = key_end - 1  # [B]
        key_pos = torch.arange(num_blocks_max * block_size).unsqueeze(0)  # [1, L]
        mask = key_pos <= q_pos.unsqueeze(1)  # [B, L]
        if sliding_window is not None:
            mask &= key_pos > (q_pos.unsqueeze(1) - sliding_window)
        meta.mask = mask.view(batch, 1, 1, -1)  # [B, 1, Q=1, L]
    return ForwardBatch(input_ids=ids, positions=positions, meta=meta, logits_indices=logits_indices)


@dataclass(frozen=True)
class ThreadPolicy:
    """How many torch threads a forward pass gets, by its size.

    Small passes (a decode step at low batch, a draft token) are memory- and dispatch-bound: a second
    thread only adds a fork/join per op, and a stall whenever another process holds a core. Larger passes
    are matmul-bound and scale with threads.
    """

    num_threads: int  # threads for passes above single_thread_max_tokens
    single_thread_max_tokens: int  # passes of at most this many tokens run on one thread

    def apply(self, num_tokens: int) -> None:
        want = 1 if num_tokens <= self.single_thread_max_tokens else self.num_threads
        if torch.get_num_threads() != want:
            torch.set_num_threads(want)


class ModelRunner:
    """Owns one model, its paged KV cache and, once workers/engine/compilation.py set it up, its compiled
    dense path (used for the shape buckets compile_stats names)."""

    def __init__(
        self, model: LlamaModel, num_blocks: int, block_size: int, threads: ThreadPolicy | None = None
    ) -> None:
        self.model = model
        self.threads = threads  # None: the process's torch thread count, untouched
        self.block_size = block_size
        dtype, self.device = model.embed.weight.dtype, model.embed.weight.device
        shape = model.kv_cache_shape(num_blocks, block_size)
        self.kv_caches = [
            (torch.zeros(shape, dtype=dtype, device=self.device), torch.zeros(shape, dtype=dtype, device=self.device))
            for _ in range(model.cfg.num_layers)
        ]
        # decode passes replayed from captured CUDA graphs (workers/engine/decode_graphs.py); None = none
        self.graphs: PassGraphs | None = None
        self.compiled: CompiledModel | None = None
        self.compile_stats = CompileStats()
        self.native: NativeAttention | None = None  # the attention kernel, where it serves (use_native)
        # the layers as one native call (workers/models/fused_decode.py), for passes of at most fused_max_tokens
        # tokens (workers/engine/fusing.py decides at start-up)
        self.fused: fused_decode.FusedLayers | None = None
        self.fused_max_tokens = 0
        # called after every forward with its timing: the speculator's cost tables
        self.on_pass: Callable[[PassTiming], None] | None = None
        self.shapes_run = ShapesRun()  # the sizes of every pass run so far

    def use_native(self, native: NativeAttention | None) -> None:
        """Attend through the native kernel from now on (where it takes the model's dtype), or SDPA for None."""
        weight = self.model.embed.weight
        is_served = native is not None and weight.device.type == "cpu" and native.supports(weight.dtype)
        self.native = native if is_served else None

    @staticmethod
    def kv_bytes_per_block(model: LlamaModel, block_size: int) -> int:
        cfg = model.cfg
        return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * model.embed.weight.element_size()

    @torch.inference_mode()
    def copy_slots(self, src_slots: list[int], dst_slots: list[int]) -> None:
        """Move K/V rows between slots in every layer (accepted tree nodes into sequence order)."""
        src = torch.tensor(src_slots, dtype=torch.long, device=self.device)
        dst = torch.tensor(dst_slots, dtype=torch.long, device=self.device)
        for k_cache, v_cache in self.kv_caches:
            for cache in (k_cache, v_cache):
                flat = cache.view(-1, *cache.shape[2:])  # [num_slots, KV, D]
                flat.index_copy_(0, dst, flat.index_select(0, src))

    def slot(self, block_table: list[int], pos: int) -> int:
        return block_table[pos // self.block_size] * self.block_size + pos % self.block_size

    def forward(self, items: list[ForwardItem]) -> torch.Tensor:  # [S, V] float32 on the host, S = sum(num_logits)
        """One forward: compiled where compile_stats says so, else eager. A compiled forward that raises
        (or would recompile: start-up compiled every bucket) is logged and counted, and this runner stays
        eager from then on; the pass reruns eager, rewriting the same K/V slots."""
        return to_host(self.forward_with_features(items)[0])

    def forward_with_features(
        self, items: list[ForwardItem], with_features: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:  # ([S, V] float32 logits, [T, hidden] features or None)
        """forward, also returning every query token's feature (the last layer's output before the final
        norm, flat in item order: what an EAGLE head reads) when `with_features`: the same single pass. Both
        stay on the model's device: the engine reads a greedy step's argmax there (workers/models/device.py).
        The features are a tensor of the pass's own, never written again: EAGLE sequences keep rows of it by
        reference (SpecState.keep_features), so a runner that computes into a buffer it reuses returns a copy."""
        start_s = time.perf_counter()
        out = self.graphs.run(items, with_features) if self.graphs is not None else None
        if out is None:  # not a pass a captured graph serves: built and dispatched op by op
            batch = build_batch(items, self.block_size, self.model.cfg.sliding_window, self.native)
            out = self._forward_batch(batch, batch.input_ids.shape[0], with_features)
        if self.device.type == "cuda":  # a pass's time is its device's work too (it feeds the pass costs that size
            torch.cuda.synchronize(self.device)  # speculation): wait for it, as the logits' copy to the host did
        report_pass(self.shapes_run, self.on_pass, items, out[0].shape[0], time.perf_counter() - start_s)
        return out

    def _forward_batch(
        self, batch: ForwardBatch, num_tokens: int, with_features: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:  # ([S, V] float32, [T, hidden] or None)
        if self.fused is not None and num_tokens <= self.fused_max_tokens and batch.meta.native is not None:
            return self._run_fused(batch, self.fused, with_features)
        return run_compiled_or_eager(
            self.compile_stats, self.bucket_of(num_tokens), self.compiled,
            lambda compiled: self._run(batch, compiled, with_features), f"forward of {num_tokens} tokens",
        )

    def bucket_of(self, num_tokens: int) -> Bucket:
        return Bucket.of(num_tokens, self.threads.single_thread_max_tokens if self.threads is not None else 1)

    def new_compiled(self) -> CompiledModel:
        """This runner's dense path under torch.compile, not yet compiled (workers/engine/compilation.py)."""
        return CompiledModel(self.model, self.kv_caches)

    def forward_with(self, items: list[ForwardItem], compiled: CompiledModel | None) -> torch.Tensor:  # [S, V]
        """One forward through `compiled` (it compiles a new shape bucket if needed), or eager for None."""
        batch = build_batch(items, self.block_size, self.model.cfg.sliding_window, self.native)
        return to_host(self._run(batch, compiled)[0])

    @torch.inference_mode()
    def _run(
        self, batch: ForwardBatch, compiled: CompiledModel | None, with_features: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:  # ([S, V] float32, [T, hidden] or None)
        if self.threads is not None:
            self.threads.apply(batch.input_ids.shape[0])
        batch = batch.to(self.device)
        if compiled is not None:
            h = compiled.hidden_states(batch.input_ids, batch.positions, batch.meta)  # [T, hidden]
        else:
            attends = [eager_attend(batch.meta, k, v, self.model.attn_scale) for k, v in self.kv_caches]
            h = self.model.hidden_states(batch.input_ids, batch.positions, attends)  # [T, hidden]
        return self.model.logits(h, batch.logits_indices), h if with_features else None  # on the model's device

    def _run_fused(
        self, batch: ForwardBatch, fused: fused_decode.FusedLayers, with_features: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:  # ([S, V] float32, [T, hidden] or None)
        # no inference_mode here: the weights need no grad (loader.py) and the native calls write through
        # pointers, so it guarded nothing, and entering it cost 1.6-2.3 % of a one-sequence decode step
        # (steps alternated in one process)
        if self.threads is not None:
            self.threads.apply(batch.input_ids.shape[0])
        # [T, hidden]: a fresh tensor, the layers' input and output. torch.embedding, not the module: the module's
        # call costs ~15 us more a step here, 1.7-2.5 % of a one-sequence decode step (its Python runs cache-cold
        # right after the layers stream their weights)
        h = torch.embedding(self.model.embed.weight, batch.input_ids)
        fused.run(h, batch.positions, batch.meta)
        if fused.logits is not None:
            return fused.logits.run(h, batch.logits_indices), h if with_features else None
        return self.model.logits(h, batch.logits_indices), h if with_features else None

    def bind_fused(self) -> fused_decode.FusedLayers | None:
        """The model's layers bound to the native kernel's library, or None where they can't run there."""
        if self.native is None or not fused_decode.supports(self.model.embed.weight, self.native):
            return None
        return fused_decode.for_model(self.model, self.kv_caches, self.native)

    def probe_forward(self, items: list[ForwardItem]) -> torch.Tensor:  # [S, V] float32 logits
        """A pass for start-up timing (fusing.py): forward."""
        return self.forward(items)
