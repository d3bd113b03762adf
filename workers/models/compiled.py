"""The dense path of a model compiled with torch.compile (inductor), paged attention left outside the graph.

One graph covers embedding -> every layer (norm -> qkv -> rotary; o-proj -> residual -> norm -> gate/up ->
down) -> the last hidden state. Attention is one opaque custom op per layer (`specfleet::paged_attention`,
as vLLM's piecewise compilation does): it writes the layer's new K/V into the paged cache and attends over
it (attention.py: the native kernel or SDPA), reading the step's metadata from an `AttentionContext` the
runner fills in before the call. So the graph's only inputs are the [T] token ids and positions: dynamo
specialises T = 1 (batch-1 decode, a draft token) and compiles one graph with a dynamic T for everything else.
Two graphs per model. An EAGLE head's dense path (fc over [feature, next-token embedding] -> its one layer)
compiles the same way (CompiledHead), its [T, hidden] features a third input.

With `freezing` (inductor's inference-only mode) the weights become constants of the graph and linear
layers run oneDNN's prepacked kernels on CPU; the frozen copies live as long as the compiled module.
"""

import contextlib
import itertools
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from workers.models.attention import AttentionMetadata, attend_paged
from workers.models.eagle_head import EagleHead
from workers.models.llama import LlamaModel


@dataclass
class AttentionContext:
    """What the opaque attention op reads: one per compiled model, its metadata replaced every step."""

    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]  # per layer (k, v) [num_blocks, block_size, KV, D]
    scale: float  # softmax scale
    meta: AttentionMetadata | None = None  # this step's; set by the runner before each compiled call


@dataclass
class _Registry:
    # context id -> context, while its CompiledModel lives
    contexts: weakref.WeakValueDictionary[int, AttentionContext] = field(default_factory=weakref.WeakValueDictionary)
    ids: Iterator[int] = field(default_factory=itertools.count)

    def add(self, context: AttentionContext) -> int:
        context_id = next(self.ids)
        self.contexts[context_id] = context
        return context_id


# The op's arguments are tensors and ints only; the context id (a constant of each model's graph) names
# the caches and metadata it works on.
_REGISTRY = _Registry()
# Every CompiledModel's graphs are entries of the same code object (_DenseStack.forward), a few per model
# (compile_stats.Bucket); dynamo's default limit of 8 would stop the third model in a process (tests make many)
_MAX_GRAPHS_PER_PROCESS = 256


@torch.library.custom_op("specfleet::paged_attention", mutates_args=())
def _paged_attention_op(
    q: torch.Tensor,  # [T, H, D] rotated
    k: torch.Tensor,  # [T, KV, D] rotated
    v: torch.Tensor,  # [T, KV, D]
    context_id: int,
    layer: int,
) -> torch.Tensor:  # [T, H * D]
    # the caches are not arguments, so the graph sees no mutation: only this op touches a layer's cache,
    # and every later layer depends on its output, so the order of writes and reads is the data flow's
    context = _REGISTRY.contexts[context_id]
    meta = context.meta
    assert meta is not None, "the runner sets the step's attention metadata before a compiled forward"
    k_cache, v_cache = context.kv_caches[layer]
    return attend_paged(q, k, v, k_cache, v_cache, meta, context.scale)


@_paged_attention_op.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, context_id: int, layer: int) -> torch.Tensor:
    return q.new_empty(q.shape[0], q.shape[1] * q.shape[2])


class _DenseStack(nn.Module):
    """model.hidden_states with the opaque op as every layer's attention (a module, so freezing sees the
    model's parameters as parameters)."""

    def __init__(self, model: LlamaModel, context_id: int) -> None:
        super().__init__()
        self.model = model
        self.context_id = context_id

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        op = torch.ops.specfleet.paged_attention
        attends = [
            lambda q, k, v, i=i: op(q, k, v, self.context_id, i) for i in range(len(self.model.layers))
        ]
        return self.model.hidden_states(input_ids, positions, attends)


class _HeadStack(nn.Module):
    """EagleHead.hidden with the opaque op as its one layer's attention. The target's embedding and rotary
    tables, which the head reads, are a submodule here, so freezing sees them as parameters too."""

    def __init__(self, head: EagleHead, context_id: int) -> None:
        super().__init__()
        self.head = head
        self.target = head.target
        self.context_id = context_id

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] long
        features: torch.Tensor,  # [T, hidden]
        positions: torch.Tensor,  # [T] long
    ) -> torch.Tensor:  # [T, hidden]
        op = torch.ops.specfleet.paged_attention
        return self.head.hidden(input_ids, features, positions, lambda q, k, v: op(q, k, v, self.context_id, 0))


class _CompiledStack:
    """A stack module under torch.compile, its attention reading `context`. Compilation is lazy (the first
    call of each shape bucket): call it with the shapes you serve inside `compiling()` at start-up. A call
    raises whatever compilation or the graph raises; the caller falls back to the eager model. Inference only:
    the weights are frozen into the graphs, so they must not change afterwards."""

    def __init__(self, stack_of: Callable[[int], nn.Module], kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 scale: float) -> None:
        self.context = AttentionContext(kv_caches, scale)
        self._stack = torch.compile(stack_of(_REGISTRY.add(self.context)), fullgraph=True)

    @staticmethod
    @contextlib.contextmanager
    def compiling() -> Iterator[None]:
        """Where compilations happen: with inductor's freezing (it is decided before torch.compile's own
        `options` apply, so it is patched around the compiling calls), and room for every model's graphs."""
        with (
            torch._inductor.config.patch(freezing=True),
            torch._dynamo.config.patch(recompile_limit=_MAX_GRAPHS_PER_PROCESS),
        ):
            yield

    def _call(self, meta: AttentionMetadata, *inputs: torch.Tensor) -> torch.Tensor:  # inputs [T, ...] -> [T, hidden]
        # fresh tensors: dynamo guards on whether an input is a view (the decode batch's are rows of one
        # tensor, a prefill's are not), and one graph per bucket must take both
        inputs = tuple(x.clone() for x in inputs)
        if inputs[0].shape[0] > 1:
            for x in inputs:
                torch._dynamo.mark_dynamic(x, 0)  # one graph for every T > 1, never one per size
        self.context.meta = meta
        try:
            return self._stack(*inputs)
        finally:
            self.context.meta = None


class CompiledModel(_CompiledStack):
    """A model's compiled dense path (embedding -> every layer -> the last hidden state)."""

    def __init__(self, model: LlamaModel, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        super().__init__(lambda context_id: _DenseStack(model, context_id), kv_caches, model.attn_scale)
        self.model = model

    def hidden_states(
        self,
        input_ids: torch.Tensor,  # [T] long
        positions: torch.Tensor,  # [T] long
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden]: the last layer's output, before the final norm
        return self._call(meta, input_ids, positions)


class CompiledHead(_CompiledStack):
    """An EAGLE head's compiled dense path (fc over the feature and the next token's embedding -> its layer),
    over the head's one-layer cache; the norm and LM head stay eager (EagleHead.logits), as the target's do."""

    def __init__(self, head: EagleHead, kv_cache: tuple[torch.Tensor, torch.Tensor]) -> None:
        super().__init__(lambda context_id: _HeadStack(head, context_id), [kv_cache], head.attn_scale)
        self.head = head

    def hidden(
        self,
        input_ids: torch.Tensor,  # [T] long: token t + 1 of each row
        features: torch.Tensor,  # [T, hidden]
        positions: torch.Tensor,  # [T] long
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden]: h_t
        return self._call(meta, input_ids, features, positions)
