"""Linear layers whose weights are prepacked for oneDNN once, at start-up, instead of at every call.

On the CPU, a bfloat16 `F.linear` goes to oneDNN, which reorders the weight into its blocked layout on every
call: at one or a few rows (decoding) that reorder reads and writes the whole weight again, so it costs as
much as the product itself. `pack()` stores each layer's weight already reordered (`Linear.packed`) and
`linear()` then calls oneDNN's product on it directly: the same kernel on the same layout, so the same bits,
row for row, whatever the number of rows, and no reorder per call (tested where the CPU has bfloat16
instructions; where oneDNN widens bfloat16 to float instead, its order of sums depends on the row count, in
F.linear too, and a row can round an ulp apart: workers/engine/packing.py keeps F.linear for a model whose
pass differs). This is what inductor's `freezing` does inside a compiled graph; here it serves the eager path,
so the target, the draft and an EAGLE head gain it without compiling. A compiled graph keeps reading the
unpacked weight (`linear()` checks that it is being traced): inductor packs its own copy.

The cost is memory: the packed copy sits beside the weight, which the compiled path, the tied embedding and
the checkpoint's names still use. `EngineConfig.linear_packing` decides (workers/engine/packing.py).
"""

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Linear):
    """nn.Linear with an optional prepacked copy of its weight (None until pack())."""

    packed: torch.Tensor | None = None  # the weight in oneDNN's layout: an opaque mkldnn tensor


def linear(x: torch.Tensor, layer: nn.Linear) -> torch.Tensor:  # [T, in] -> [T, out]
    """layer(x), through the packed weight where there is one (and the call is not being compiled)."""
    packed = getattr(layer, "packed", None)
    if packed is None or torch.compiler.is_compiling():
        return F.linear(x, layer.weight, layer.bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed, layer.bias, "none", [], "")


def can_pack(weight: torch.Tensor) -> bool:
    """oneDNN's packed product serves this weight: a CPU float32/bfloat16 weight, in a build with oneDNN, and for
    bfloat16 a CPU with oneDNN's bfloat16 path (AVX-512 BW/VL/DQ or AVX-NE-CONVERT: on an AVX2-only CPU the
    reorder raises)."""
    return (
        weight.device.type == "cpu"
        and weight.dtype in (torch.float32, torch.bfloat16)
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and (weight.dtype != torch.bfloat16 or has_bfloat16_path())
    )


def has_bfloat16_path() -> bool:
    """Whether this CPU runs oneDNN's bfloat16 products (torch's own check)."""
    check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return bool(check()) if check is not None else False


def layers_of(module: nn.Module) -> list[Linear]:
    """Every packable Linear of the module, its own and its children's."""
    return [m for m in module.modules() if isinstance(m, Linear) and can_pack(m.weight)]


@torch.inference_mode()
def pack(layers: list[Linear]) -> None:
    for layer in layers:
        layer.packed = torch.ops.mkldnn._reorder_linear_weight(layer.weight.detach())


def unpack(layers: list[Linear]) -> None:
    for layer in layers:
        layer.packed = None
