"""A model's decoder layers (or an EAGLE head's one) as one native call (decode_layers.cpp).

At one token a layer's dense path is ~25 tensor ops, each 3-70 us to dispatch, against a few microseconds of
arithmetic: the eager pass of the 12-layer demo target spends most of its ~6-8 ms there. The native call
runs every layer (norms, qkv, rotary, the paged attention kernel, o-proj, the MLP, residuals) in C++ over the
model's own weights and KV caches, the same arithmetic as the eager path (see the .cpp), and returns the last
layer's output. A second call (NativeLogits) runs the final norm and the LM head over the rows that take
logits, and an EAGLE head's fc is a native product before its layer (NativeLinear); the embedding stays in
torch.

It serves CPU models in float32 or bfloat16 whose passes the native attention kernel serves (the metadata
carries its ragged view). Which passes take it (every pass up to the runner's fused_max_tokens: `auto` sets
all or none) is the engine's decision, measured at start-up (workers/engine/fusing.py). The linear weights are
repacked here once (pack_weight) into the layout the library's products read.
"""

import ctypes
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from workers.models.attention import AttentionMetadata
from workers.models.config import ModelConfig
from workers.models.eagle_head import EagleHead
from workers.models.llama import DecoderLayer, LlamaModel
from workers.models.native_attention import NativeAttention

_ENTRY_POINTS = {torch.float32: "specfleet_decode_layers_f32", torch.bfloat16: "specfleet_decode_layers_bf16"}
_LINEAR_ENTRY_POINTS = {torch.float32: "specfleet_linear_f32", torch.bfloat16: "specfleet_linear_bf16"}
_LOGITS_ENTRY_POINTS = {torch.float32: "specfleet_final_logits_f32", torch.bfloat16: "specfleet_final_logits_bf16"}
_NUM_DIMS = 10
PACKED_TILE_OUTPUTS = 64  # decode_layers.cpp's kTileOutputs: packed weights' outputs, a tile after another


def _function(native: NativeAttention, name: str, num_pointers: int, num_tail: int, tail_type: Any) -> Any:
    function = getattr(ctypes.CDLL(str(native.library_path)), name)  # the library native already loaded
    function.argtypes = [ctypes.c_void_p] * num_pointers + [tail_type] * num_tail
    function.restype = None
    return function


def pair_rows(native: NativeAttention, dtype: torch.dtype) -> int:
    """How the library's linear layers read this dtype's weights (pack_weight): 0 = in columns; else in pairs,
    their count padded to a multiple of this (16 where AMX tiles read them)."""
    if dtype != torch.bfloat16:
        return 0
    query = ctypes.CDLL(str(native.library_path)).specfleet_linear_pairs_bf16
    query.argtypes, query.restype = [], ctypes.c_int64
    return int(query())


def supports(weight: torch.Tensor, native: NativeAttention | None) -> bool:
    """Whether layers whose weights are like `weight` can run natively (a CPU float32/bfloat16 tensor)."""
    return native is not None and weight.device.type == "cpu" and weight.dtype in _ENTRY_POINTS


@dataclass
class FusedLayers:
    """A stack of decoder layers bound to the native entry point: their tensors' addresses, taken once (the
    module and its caches must outlive this, and their tensors stay where they are: nothing here holds them)."""

    cfg: ModelConfig  # the layers' shape: heads, sizes, eps (num_layers: how many)
    function: Any  # ctypes entry point
    layer_tensors: torch.Tensor  # [num_layers, 12] int64: decode_layers.cpp's LayerTensor order
    packed_weights: list[torch.Tensor]  # the linear weights packed for the kernel (layer_tensors point at them)
    rope: tuple[torch.Tensor, torch.Tensor]  # cos, sin tables [max_len, head_dim], the layers' dtype
    scale: float  # softmax scale
    block_size: int  # the caches' tokens per block
    logits: "NativeLogits | None" = None  # the final norm and LM head after the layers (for_model, for_head)
    first: "NativeLinear | None" = None  # a product before the layers: an EAGLE head's fc (for_head)

    @classmethod
    def bind(
        cls,
        layers: Sequence[nn.Module],  # DecoderLayer each
        cfg: ModelConfig,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # per layer (k, v) [num_blocks, block_size, KV, D]
        rope: tuple[torch.Tensor, torch.Tensor],
        scale: float,
        native: NativeAttention,
    ) -> "FusedLayers":
        dtype = kv_caches[0][0].dtype

        def address(tensor: torch.Tensor | None) -> int:
            if tensor is None:
                return 0
            assert tensor.is_contiguous() and tensor.dtype == dtype, "the native layers read every tensor densely"
            return tensor.data_ptr()

        pairs = pair_rows(native, dtype)
        packed: list[torch.Tensor] = []  # the linear weights in the kernel's layouts, alive as long as this

        def weight_address(tensor: torch.Tensor) -> int:
            packed.append(pack_weight(tensor.detach(), pairs))
            return packed[-1].data_ptr()

        rows = []
        for layer, (k_cache, v_cache) in zip(layers, kv_caches, strict=True):
            assert isinstance(layer, DecoderLayer)
            linears = (layer.qkv, layer.o_proj)
            mlp = (layer.gate_up, layer.down)
            rows.append([
                address(layer.input_norm.weight),
                *(a for lin in linears for a in (weight_address(lin.weight), address(lin.bias))),
                address(layer.post_norm.weight),
                *(a for lin in mlp for a in (weight_address(lin.weight), address(lin.bias))),
                address(k_cache), address(v_cache),
            ])  # fmt: skip
        for table in rope:
            address(table)  # checked: read densely too
        function = _function(native, _ENTRY_POINTS[dtype], 13, 2, ctypes.c_double)
        tensors = torch.tensor(rows, dtype=torch.long)
        layers_cfg = dataclasses.replace(cfg, num_layers=len(rows))
        return cls(layers_cfg, function, tensors, packed, rope, scale, kv_caches[0][0].shape[1])

    def run(
        self,
        h: torch.Tensor,  # [T, hidden] contiguous: the first layer's input, overwritten with the last one's output
        positions: torch.Tensor,  # [T] long
        meta: AttentionMetadata,  # with the native kernel's ragged view
    ) -> None:
        cfg = self.cfg
        ragged = (meta.token_seq, meta.key_start, meta.key_end, meta.tree_base, meta.tree_bits)
        assert all(x is not None for x in ragged), "the pass's metadata has the native kernel's view"
        assert h.is_contiguous() and h.dtype == self.rope[0].dtype
        positions = positions.contiguous()
        block_tables = meta.block_tables.contiguous()
        dims = (ctypes.c_int64 * _NUM_DIMS)(
            h.shape[0], cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size,
            cfg.num_layers, self.block_size, block_tables.shape[1], torch.get_num_threads(),
        )
        self.function(
            h.data_ptr(), self.layer_tensors.data_ptr(), self.rope[0].data_ptr(), self.rope[1].data_ptr(),
            positions.data_ptr(), meta.slot_mapping.data_ptr(), block_tables.data_ptr(),
            *(x.data_ptr() for x in ragged if x is not None), dims, cfg.rms_norm_eps, self.scale,
        )


@dataclass
class NativeLinear:
    """One linear layer as a native call, the weight packed once: x [M, K] -> [M, N] in x's dtype (the layers'
    product, rounded once as the eager F.linear's output)."""

    function: Any  # ctypes entry point
    packed: torch.Tensor  # the weight [N, K] in the kernel's layout (pack_weight)
    bias: torch.Tensor | None  # [N], read in place
    num_out: int  # N
    num_in: int  # K

    @classmethod
    def bind(cls, layer: nn.Linear, native: NativeAttention) -> "NativeLinear":
        return cls.of(layer.weight.detach(), layer.bias.detach() if layer.bias is not None else None, native)

    @classmethod
    def of(cls, weight: torch.Tensor, bias: torch.Tensor | None, native: NativeAttention) -> "NativeLinear":
        """weight [N, K], bias [N] or None."""
        assert bias is None or (bias.is_contiguous() and bias.dtype == weight.dtype)
        function = _function(native, _LINEAR_ENTRY_POINTS[weight.dtype], 4, 4, ctypes.c_int64)
        packed = pack_weight(weight, pair_rows(native, weight.dtype))
        return cls(function, packed, bias, weight.shape[0], weight.shape[1])

    def run(self, x: torch.Tensor, num_threads: int | None = None) -> torch.Tensor:  # [M, K] -> [M, N]
        """num_threads: torch's current count unless given."""
        x = x.contiguous()
        assert x.shape[1] == self.num_in and x.dtype == self.packed.dtype
        out = x.new_empty(x.shape[0], self.num_out)
        self.function(x.data_ptr(), self.packed.data_ptr(), self.bias.data_ptr() if self.bias is not None else None,
                      out.data_ptr(), x.shape[0], self.num_out, self.num_in, num_threads or torch.get_num_threads())
        return out


@dataclass
class NativeLogits:
    """The final norm and an LM head as one native call: the logits of a pass's rows, over the last layer's output
    (the weights packed once, as the layers' are; the norm's weight is read in place and must outlive this)."""

    function: Any  # ctypes entry point
    norm_weight: torch.Tensor  # [hidden]
    packed: torch.Tensor  # the LM head's weight [V, hidden] in the kernel's layout (pack_weight)
    vocab_size: int  # V: the head's outputs
    eps: float

    @classmethod
    def bind(
        cls,
        norm_weight: torch.Tensor,  # [hidden]: the final norm's
        head_weight: torch.Tensor,  # [V, hidden]: the LM head's
        eps: float,
        native: NativeAttention,
    ) -> "NativeLogits":
        dtype = head_weight.dtype
        assert norm_weight.is_contiguous() and norm_weight.dtype == dtype
        packed = pack_weight(head_weight.detach(), pair_rows(native, dtype))
        function = _function(native, _LOGITS_ENTRY_POINTS[dtype], 5, 3, ctypes.c_int64)
        function.argtypes += [ctypes.c_double, ctypes.c_int64]  # eps, num_threads
        return cls(function, norm_weight.detach(), packed, head_weight.shape[0], eps)

    def run(
        self,
        h: torch.Tensor,  # [T, hidden] contiguous: the last layer's output
        rows: torch.Tensor,  # [S] long: the rows that take logits
    ) -> torch.Tensor:  # [S, V] float32
        assert h.is_contiguous() and h.dtype == self.norm_weight.dtype
        rows = rows.contiguous()
        out = torch.empty(rows.shape[0], self.vocab_size, dtype=torch.float32)
        self.function(h.data_ptr(), rows.data_ptr(), self.norm_weight.data_ptr(), self.packed.data_ptr(),
                      out.data_ptr(), rows.shape[0], h.shape[1], self.vocab_size, self.eps, torch.get_num_threads())
        return out


def for_model(
    model: LlamaModel, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], native: NativeAttention
) -> FusedLayers:
    """Every layer of a model (its input: the embedding of the pass's tokens)."""
    rope = (model.cos_table, model.sin_table)
    layers = FusedLayers.bind(list(model.layers), model.cfg, kv_caches, rope, model.attn_scale, native)
    layers.logits = NativeLogits.bind(model.norm.weight, model.lm_head.weight, model.cfg.rms_norm_eps, native)
    return layers


def for_head(head: EagleHead, kv_cache: tuple[torch.Tensor, torch.Tensor], native: NativeAttention) -> FusedLayers:
    """An EAGLE head's one layer (its input: fc over [feature, next-token embedding], natively too), on the
    target's rotary tables."""
    target = head.target
    rope = (target.cos_table, target.sin_table)
    layers = FusedLayers.bind([head.layer], head.layer_cfg, [kv_cache], rope, head.attn_scale, native)
    layers.logits = NativeLogits.bind(target.norm.weight, head.head_weight(), target.cfg.rms_norm_eps, native)
    layers.first = NativeLinear.bind(head.fc, native)
    return layers


def pack_weight(weight: torch.Tensor, pairs: int) -> torch.Tensor:  # [N, K] -> the kernel's layout
    """A linear weight in decode_layers.cpp's layout: outputs padded with zeros to a multiple of 64 and stored a
    tile of 64 after another; for pairs > 0, pairs [N_pad / 64, K2, 64, 2] with K2 = ceil(K / 2) padded to a
    multiple of `pairs` (bfloat16 on CPUs with its dot instruction or AMX), else columns [N_pad / 64, K, 64]."""
    num_out, num_in = weight.shape
    num_tiles = -(-num_out // PACKED_TILE_OUTPUTS)
    if not pairs:
        padded = weight.new_zeros(num_tiles * PACKED_TILE_OUTPUTS, num_in)  # [N_pad, K]
        padded[:num_out] = weight
        return padded.view(num_tiles, PACKED_TILE_OUTPUTS, num_in).transpose(1, 2).contiguous()  # [tiles, K, 64]
    num_pairs = -(-num_in // (2 * pairs)) * pairs
    padded = weight.new_zeros(num_tiles * PACKED_TILE_OUTPUTS, 2 * num_pairs)  # [N_pad, 2 K2]
    padded[:num_out, :num_in] = weight
    tiles = padded.view(num_tiles, PACKED_TILE_OUTPUTS, num_pairs, 2)  # [tiles, 64, K2, 2]
    return tiles.transpose(1, 2).contiguous()  # [tiles, K2, 64, 2]


def native_linear(native: NativeAttention, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  num_threads: int = 1) -> torch.Tensor:  # x [M, K], weight [N, K] -> [M, N]
    """The native layers' product on its own, the weight packed on the way (tests compare it with F.linear)."""
    return NativeLinear.of(weight, bias, native).run(x, num_threads)
