"""Prepacked linear weights (workers/models/packed_linear.py): oneDNN's product on the packed bfloat16 weight
gives F.linear's bits, for every row count, each row the same alone as in a batch (where the CPU has bfloat16
instructions; elsewhere within a rounding); unpacked layers and compiled graphs take F.linear."""

import pytest
import torch
import torch.nn.functional as F

from tests.helpers.models import cpu_flags
from workers.models import packed_linear
from workers.models.packed_linear import Linear, linear

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch has no oneDNN")
HAS_BFLOAT16_PATH = packed_linear.has_bfloat16_path()  # AVX-512 BW/VL/DQ or AVX-NE-CONVERT; not AVX2 alone
PACKABLE = torch.bfloat16 if HAS_BFLOAT16_PATH else torch.float32  # what oneDNN packs on this CPU
# oneDNN's bfloat16 products run on the CPU's bfloat16 instructions, in one order of sums whatever the row
# count; without them (an AVX-512 CPU without AVX512-BF16) it widens to float and sums in an order that
# depends on the row count and the kernel: a row alone can differ from the same row in a batch by one bfloat16
# rounding, in F.linear as in the packed product (seen on such a host: 1-3 rows of 40 an ulp apart)
HAS_BFLOAT16_INSTRUCTIONS = bool({"avx512_bf16", "amx_bf16"} & cpu_flags())


def packable_layer(in_features: int, out_features: int, bias: bool, dtype: torch.dtype = PACKABLE) -> Linear:
    torch.manual_seed(in_features + out_features)
    layer = Linear(in_features, out_features, bias=bias).to(dtype)
    assert packed_linear.layers_of(layer) == [layer]
    return layer


@pytest.mark.skipif(not HAS_BFLOAT16_PATH, reason="this CPU has no oneDNN bfloat16 path")
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(("in_features", "out_features"), [(64, 192), (160, 64), (64, 1000)])
@torch.inference_mode()
def test_the_packed_product_has_f_linear_bits_for_every_row_count(in_features, out_features, bias) -> None:
    layer = packable_layer(in_features, out_features, bias, torch.bfloat16)
    x = torch.randn(40, in_features).to(torch.bfloat16)  # [M, in]
    reference = F.linear(x, layer.weight, layer.bias)  # [M, out]
    packed_linear.pack([layer])
    assert layer.packed is not None and layer.packed.is_mkldnn
    for num_rows in range(1, 41):
        same_bits(linear(x[:num_rows], layer), reference[:num_rows])
    alone = torch.cat([linear(x[i : i + 1], layer) for i in range(40)])  # [M, out]: row by row
    same_bits(alone, reference)


def same_bits(out: torch.Tensor, reference: torch.Tensor) -> None:
    """Bit for bit where oneDNN runs bfloat16 instructions; elsewhere within one bfloat16 rounding of the
    float sum (workers/engine/packing.py checks a model's own pass at start-up and keeps F.linear if they
    differ)."""
    if HAS_BFLOAT16_INSTRUCTIONS:
        assert torch.equal(out, reference)
    else:
        torch.testing.assert_close(out.float(), reference.float(), atol=1e-5, rtol=2**-7)


@torch.inference_mode()
def test_unpacked_layers_and_plain_modules_take_f_linear() -> None:
    layer = packable_layer(32, 48, bias=True)
    x = torch.randn(3, 32).to(PACKABLE)
    assert layer.packed is None and torch.equal(linear(x, layer), F.linear(x, layer.weight, layer.bias))
    packed_linear.pack([layer])
    packed_linear.unpack([layer])
    assert layer.packed is None
    plain = torch.nn.Linear(32, 48).to(PACKABLE)  # not ours: never packed, still served
    assert torch.equal(linear(x, plain), F.linear(x, plain.weight, plain.bias))
    assert packed_linear.layers_of(plain) == []


def test_only_cpu_float32_and_bfloat16_weights_are_packable() -> None:
    """bfloat16 where the CPU has oneDNN's bfloat16 path: on an AVX2-only CPU its reorder raises."""
    assert packed_linear.can_pack(torch.zeros(2, 2, dtype=torch.float32))
    assert packed_linear.can_pack(torch.zeros(2, 2, dtype=torch.bfloat16)) == HAS_BFLOAT16_PATH
    assert not packed_linear.can_pack(torch.zeros(2, 2, dtype=torch.float64))
    assert not packed_linear.can_pack(torch.zeros(2, 2, dtype=torch.float16))


def test_a_compiled_graph_reads_the_unpacked_weight() -> None:
    """Dynamo never traces the opaque packed tensor: under compilation linear() is F.linear, same bits."""
    layer = packable_layer(32, 48, bias=False)
    packed_linear.pack([layer])
    x = torch.randn(4, 32).to(PACKABLE)
    compiled = torch.compile(lambda t: linear(t, layer), backend="eager", fullgraph=True)
    with torch.inference_mode():
        assert torch.equal(compiled(x), F.linear(x, layer.weight))
