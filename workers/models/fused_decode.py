"""A model's decoder layers as one native call (decode_layers.cpp), for passes of a few tokens.

At one token a layer's dense path is ~25 tensor ops, each 3-70 us to dispatch, against a few microseconds of
arithmetic: the eager pass of the 12-layer demo target spends most of its ~6-8 ms there. The native call
runs every layer (norms, qkv, rotary, the paged attention kernel, o-proj, the MLP, residuals) in C++ over the
model's own weights and KV caches, the same arithmetic as the eager path (see the .cpp), and returns the last
layer's output: the embedding and the final norm and head stay in torch.

It serves CPU models in float32 or bfloat16 whose passes the native attention kernel serves (the metadata
carries its ragged view). Which passes take it is the engine's decision, measured at start-up
(workers/engine/fusing.py).
"""

import ctypes
from dataclasses import dataclass
from typing import Any

import torch

from workers.models.attention import AttentionMetadata
from workers.models.llama import DecoderLayer, LlamaModel
from workers.models.native_attention import NativeAttention

_ENTRY_POINTS = {torch.float32: "specfleet_decode_layers_f32", torch.bfloat16: "specfleet_decode_layers_bf16"}
_LINEAR_ENTRY_POINTS = {torch.float32: "specfleet_linear_f32", torch.bfloat16: "specfleet_linear_bf16"}
_NUM_DIMS = 10


def _function(native: NativeAttention, name: str, num_pointers: int, num_tail: int, tail_type: Any) -> Any:
    function = getattr(ctypes.CDLL(str(native.library_path)), name)  # the library native already loaded
    function.argtypes = [ctypes.c_void_p] * num_pointers + [tail_type] * num_tail
    function.restype = None
    return function


def supports(model: LlamaModel, native: NativeAttention | None) -> bool:
    weight = model.embed.weight
    return native is not None and weight.device.type == "cpu" and weight.dtype in _ENTRY_POINTS


@dataclass
class FusedDecode:
    """One model's layers bound to the native entry point: their tensors' addresses, taken once (the model and
    its caches must outlive this, and their tensors stay where they are: nothing here holds them)."""

    model: LlamaModel
    function: Any  # ctypes entry point
    layer_tensors: torch.Tensor  # [num_layers, 12] int64: decode_layers.cpp's LayerTensor order
    block_size: int  # the caches' tokens per block

    @classmethod
    def bind(
        cls, model: LlamaModel, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], native: NativeAttention
    ) -> "FusedDecode":
        function = _function(native, _ENTRY_POINTS[model.embed.weight.dtype], 13, 2, ctypes.c_double)

        def address(tensor: torch.Tensor | None) -> int:
            if tensor is None:
                return 0
            assert tensor.is_contiguous(), "the native layers read every weight densely"
            return tensor.data_ptr()

        rows = []
        for layer, (k_cache, v_cache) in zip(model.layers, kv_caches, strict=True):
            assert isinstance(layer, DecoderLayer)
            linears = (layer.qkv, layer.o_proj)
            mlp = (layer.gate_up, layer.down)
            rows.append([
                address(layer.input_norm.weight), *(address(t) for lin in linears for t in (lin.weight, lin.bias)),
                address(layer.post_norm.weight), *(address(t) for lin in mlp for t in (lin.weight, lin.bias)),
                address(k_cache), address(v_cache),
            ])  # fmt: skip
        return cls(model, function, torch.tensor(rows, dtype=torch.long), kv_caches[0][0].shape[1])

    def hidden_states(
        self,
        input_ids: torch.Tensor,  # [T] long
        positions: torch.Tensor,  # [T] long
        meta: AttentionMetadata,  # with the native kernel's ragged view
    ) -> torch.Tensor:  # [T, hidden]: the last layer's output, before the final norm
        model, cfg = self.model, self.model.cfg
        h = model.embed(input_ids)  # [T, hidden], a fresh tensor the call overwrites
        ragged = (meta.token_seq, meta.key_start, meta.key_end, meta.tree_base, meta.tree_bits)
        assert all(x is not None for x in ragged), "the pass's metadata has the native kernel's view"
        positions = positions.contiguous()
        block_tables = meta.block_tables.contiguous()
        dims = (ctypes.c_int64 * _NUM_DIMS)(
            h.shape[0], cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size,
            cfg.num_layers, self.block_size, block_tables.shape[1], torch.get_num_threads(),
        )
        self.function(
            h.data_ptr(), self.layer_tensors.data_ptr(), model.cos_table.data_ptr(), model.sin_table.data_ptr(),
            positions.data_ptr(), meta.slot_mapping.data_ptr(), block_tables.data_ptr(),
            *(x.data_ptr() for x in ragged if x is not None), dims, cfg.rms_norm_eps, model.attn_scale,
        )
        return h


def native_linear(native: NativeAttention, x: torch.Tensor, weight: torch.Tensor,
                  bias: torch.Tensor | None) -> torch.Tensor:  # x [M, K], weight [N, K] -> [M, N]
    """The native layers' product on its own (tests and benchmarks compare it with F.linear)."""
    function = _function(native, _LINEAR_ENTRY_POINTS[x.dtype], 4, 3, ctypes.c_int64)
    x, weight = x.contiguous(), weight.contiguous()
    out = x.new_empty(x.shape[0], weight.shape[0])
    function(x.data_ptr(), weight.data_ptr(), bias.data_ptr() if bias is not None else None, out.data_ptr(),
             x.shape[0], weight.shape[0], x.shape[1])
    return out
