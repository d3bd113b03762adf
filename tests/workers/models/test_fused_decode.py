"""The native decoder layers (workers/models/fused_decode.py, decode_layers.cpp) against the eager path they
replace, for every layout and both dtypes, on decode tokens, chains, ragged batches and prefill chunks; and
their product on its own against an exact reference."""

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import REPO_ROOT
from tests.helpers.models import HAS_SEPARATE_AVX2_BUILD, cpu_flags
from workers.engine.head_runner import HeadRunner
from workers.engine.model_runner import ForwardItem, ModelRunner
from workers.models.eagle_head import load_head
from workers.models.fused_decode import NativeLogits, native_linear, pair_rows
from workers.models.loader import load_model
from workers.models.native_attention import NativeAttention, load

LAYOUTS = ("llama", "qwen2", "mistral")  # qwen2: q/k/v biases; mistral: a sliding window
BLOCK_SIZE = 4
NUM_BLOCKS = 40
# logits of the eager and native paths (tiny models: logits of magnitude ~10). float32: their sums run in
# another order; bfloat16: an element rounded the other way at one op moves later ones by an ulp (2^-8)
EVERY_PASS = 1 << 20  # fused_max_tokens: no pass is larger
LOGITS_TOLERANCE = {torch.float32: dict(atol=1e-4, rtol=0), torch.bfloat16: dict(atol=0.25, rtol=0.02)}


@pytest.fixture(scope="module")
def portable_kernel(tmp_path_factory: pytest.TempPathFactory) -> NativeAttention:
    """The library built without AVX512-BF16 (on hosts without it, the same as native_kernel): bfloat16 products
    through float FMAs over the columns layout, the path of AVX2 hosts."""
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("-mno-avx512bf16 is an x86 flag")
    kernel = load(tmp_path_factory.mktemp("portable-kernel"), ("-mno-avx512bf16", "-mno-amx-tile"))
    assert kernel is not None, "the native kernel did not build without AVX512-BF16 (see the log)"
    return kernel


def test_the_weight_layout_follows_the_cpu(native_kernel: NativeAttention, portable_kernel: NativeAttention) -> None:
    """bfloat16 pairs for the dot instruction exactly where the build has it (padded for AMX tiles where it has
    those too); float32 always in columns."""
    flags = cpu_flags()
    want = 16 if {"amx_tile", "amx_bf16", "avx512_bf16"} <= flags else 1 if "avx512_bf16" in flags else 0
    assert pair_rows(native_kernel, torch.bfloat16) == want
    assert pair_rows(portable_kernel, torch.bfloat16) == 0
    assert pair_rows(native_kernel, torch.float32) == 0


@pytest.fixture(params=["native", "portable", *(["avx2"] if HAS_SEPARATE_AVX2_BUILD else [])])
def kernel(request: pytest.FixtureRequest, native_kernel: NativeAttention) -> NativeAttention:
    """Every build: this host's (the pairs layout where it has AVX512-BF16), the portable one and, on AVX-512
    hosts, the AVX2 one."""
    return native_kernel if request.param == "native" else request.getfixturevalue(f"{request.param}_kernel")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# blocks of 4 rows (16 for AMX tiles, 6 for AVX2's and AVX-512's columns), remainders
@pytest.mark.parametrize("num_rows", [1, 2, 3, 5, 9, 16, 21])
@pytest.mark.parametrize(("num_out", "num_in"), [(13, 40), (64, 64), (7, 96), (5, 33)])  # weight-row and K remainders, odd K
@pytest.mark.parametrize("has_bias", [False, True])
def test_native_linear_matches_the_exact_product(
    kernel: NativeAttention, dtype: torch.dtype, num_rows: int, num_out: int, num_in: int, has_bias: bool
) -> None:
    gen = torch.Generator().manual_seed(num_rows * 1000 + num_out)
    x = torch.randn(num_rows, num_in, generator=gen).to(dtype)
    weight = torch.randn(num_out, num_in, generator=gen).to(dtype)
    bias = torch.randn(num_out, generator=gen).to(dtype) if has_bias else None
    out = native_linear(kernel, x, weight, bias)
    exact = F.linear(x.double(), weight.double(), bias.double() if bias is not None else None)  # [M, N]
    assert out.dtype == dtype and out.shape == (num_rows, num_out)
    # float32 sums in another order; bfloat16 accumulates in float32 and rounds once: within its half-ulp
    torch.testing.assert_close(out.double(), exact.to(dtype).double(), atol=1e-4, rtol=2**-8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_in", [96, 33])  # even, odd K
def test_a_rows_product_does_not_depend_on_the_pass_size(kernel: NativeAttention, dtype: torch.dtype, num_in: int) -> None:
    """The same bits for a row alone, in a small batch and in a long pass: decoding, a verified chain and a
    resumed job's prefill agree."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(37, num_in, generator=gen).to(dtype)
    weight, bias = torch.randn(80, num_in, generator=gen).to(dtype), torch.randn(80, generator=gen).to(dtype)
    whole = native_linear(kernel, x, weight, bias)  # [37, 80]
    for num_rows in (1, 2, 5, 16, 17):
        assert torch.equal(native_linear(kernel, x[:num_rows], weight, bias), whole[:num_rows])


TEAM_OF_ONE_CHILD = """
import sys
from pathlib import Path

import torch

from workers.models.fused_decode import native_linear
from workers.models.native_attention import NativeAttention

kernel = NativeAttention(Path(sys.argv[1]), {}, None)
gen = torch.Generator().manual_seed(5)
x = torch.randn(16, 96, generator=gen).to(torch.bfloat16)
weight, bias = torch.randn(200, 96, generator=gen).to(torch.bfloat16), torch.randn(200, generator=gen).to(torch.bfloat16)
assert torch.equal(native_linear(kernel, x, weight, bias, num_threads=2), native_linear(kernel, x, weight, bias))
print("same bits")
"""


@pytest.mark.parametrize("limit", [{"OMP_THREAD_LIMIT": "1"}, {"OMP_DYNAMIC": "true", "OMP_THREAD_LIMIT": "1"}])
def test_a_product_asked_for_two_threads_runs_where_the_runtime_gives_one(
    kernel: NativeAttention, limit: dict[str, str]
) -> None:
    """A bf16 product on the columns path outside a parallel region opens one of its own (each thread widens x
    for itself, linear_wide); where the OpenMP runtime gives that region a single thread, it must not take it
    for no region at all and open another, and another (the stack ran out: a segfault). Same bits as one thread."""
    env = {**os.environ, **limit, "PYTHONPATH": str(REPO_ROOT)}
    child = subprocess.run([sys.executable, "-c", TEAM_OF_ONE_CHILD, str(kernel.library_path)], env=env,
                           capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
    assert child.returncode == 0 and "same bits" in child.stdout, child.stderr[-2000:]


def runners(model_dir: Path, dtype: torch.dtype, native: NativeAttention) -> tuple[ModelRunner, ModelRunner]:
    """(eager, native layers for every pass): the same weights, caches of their own."""
    eager, fused = (ModelRunner(load_model(model_dir, dtype), NUM_BLOCKS, BLOCK_SIZE) for _ in range(2))
    for runner in (eager, fused):
        runner.use_native(native)
    fused.fused = fused.bind_fused()
    assert fused.fused is not None
    fused.fused_max_tokens = EVERY_PASS
    return eager, fused


# (passes in order): a prefill chunk per sequence, then decode tokens, a chain, a ragged batch, a long chunk
PASSES = [
    [ForwardItem(list(range(3, 10)), 0, [7, 2, 30], num_logits=7)],
    [ForwardItem(list(range(20, 31)), 0, [5, 11, 3], num_logits=1)],
    [ForwardItem([40], 7, [7, 2, 30], num_logits=1)],
    [ForwardItem([41], 8, [7, 2, 30], num_logits=1)],
    [ForwardItem([42, 43, 44], 9, [7, 2, 30, 19], num_logits=3)],
    [ForwardItem([45], 11, [5, 11, 3], num_logits=1), ForwardItem([46, 47], 12, [7, 2, 30, 19], num_logits=2)],
    [ForwardItem(list(range(50, 63)), 14, [7, 2, 30, 19, 23, 29, 31, 33], num_logits=13)],
]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_layers_equal_the_eager_path(
    tiny_models: dict[str, Path], kernel: NativeAttention, layout: str, dtype: torch.dtype
) -> None:
    eager, fused = runners(tiny_models[layout], dtype, kernel)
    for items in PASSES:
        want, want_h = eager.forward_with_features(items, with_features=True)
        got, got_h = fused.forward_with_features(items, with_features=True)
        torch.testing.assert_close(got, want, **LOGITS_TOLERANCE[dtype])
        assert torch.equal(got.argmax(-1), want.argmax(-1))
        assert got_h is not None and want_h is not None and got_h.shape == want_h.shape
    blocks = sorted({b for items in PASSES for it in items for b in it.block_table})
    for (k_want, v_want), (k_got, v_got) in zip(eager.kv_caches, fused.kv_caches, strict=True):
        for want_cache, got_cache in ((k_want, k_got), (v_want, v_got)):  # the K/V written, block for block
            torch.testing.assert_close(got_cache[blocks].float(), want_cache[blocks].float(),
                                       **LOGITS_TOLERANCE[dtype])  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_logits_equal_the_eager_norm_and_head(
    tiny_models: dict[str, Path], kernel: NativeAttention, dtype: torch.dtype
) -> None:
    """The final norm and LM head natively: the eager logits of the rows asked for, and a row's bits the same
    whatever the rows beside it (a decode, a verified chain and a resumed job's prefill agree)."""
    model = load_model(tiny_models["llama"], dtype)
    head = NativeLogits.bind(model.norm.weight, model.lm_head.weight, model.cfg.rms_norm_eps, kernel)
    h = (torch.randn(23, model.cfg.hidden_size, generator=torch.Generator().manual_seed(9)) * 3).to(dtype)
    rows = torch.tensor([0, 4, 5, 11, 22, 7, 19, 2, 3, 13, 16, 17, 18, 20, 21, 1, 6, 8])  # 18 rows: an AMX tile and more
    with torch.inference_mode():
        want = model.logits(h, rows)  # [S, V] float32
    got = head.run(h, rows)
    assert got.dtype == torch.float32 and got.shape == want.shape
    torch.testing.assert_close(got, want, **LOGITS_TOLERANCE[dtype])
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    for num_rows in (1, 2, 5, 16, 17):
        assert torch.equal(head.run(h, rows[:num_rows]), got[:num_rows])


@pytest.mark.parametrize("head_name", ["copy_head", "vocab_head"])  # vocab_head: a draft vocabulary
def test_an_eagle_heads_native_layer_equals_its_eager_pass(
    eagle_models: dict[str, Path], native_kernel: NativeAttention, head_name: str
) -> None:
    """The head's one layer natively, over features and next tokens: the eager head's logits and h."""
    target = load_model(eagle_models["target"], torch.float32)
    eager, fused = (HeadRunner(load_head(eagle_models[head_name], target), NUM_BLOCKS, BLOCK_SIZE) for _ in range(2))
    for runner in (eager, fused):
        runner.use_native(native_kernel)
    fused.fused = fused.bind_fused()
    assert fused.fused is not None and fused.fused.cfg.num_layers == 1
    fused.fused_max_tokens = EVERY_PASS
    gen = torch.Generator().manual_seed(5)
    for items in PASSES:
        num_tokens = sum(len(it.token_ids) for it in items)
        features = torch.randn(num_tokens, target.cfg.hidden_size, generator=gen)  # [T, hidden]
        (want, want_h), (got, got_h) = eager.forward(items, features), fused.forward(items, features)
        torch.testing.assert_close(got, want, **LOGITS_TOLERANCE[torch.float32])  # -inf where want has -inf
        torch.testing.assert_close(got_h, want_h, atol=1e-4, rtol=0)


def test_only_passes_up_to_the_limit_take_the_native_layers(tiny_models: dict[str, Path], native_kernel: NativeAttention) -> None:
    """A runner with the layers bound for one-token passes only runs larger passes eagerly: bit for bit the
    eager runner's logits there."""
    eager, fused = runners(tiny_models["llama"], torch.float32, native_kernel)
    fused.fused_max_tokens = 1
    prefill = PASSES[0]
    assert torch.equal(fused.forward(prefill), eager.forward(prefill))  # 7 tokens: eager on both
    decode = [ForwardItem([40], 7, [7, 2, 30], num_logits=1)]
    got, want = fused.forward(decode), eager.forward(decode)
    assert not torch.equal(got, want)  # the native sums: close, not the same bits
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def test_models_the_layers_cannot_serve(tiny_models: dict[str, Path], native_kernel: NativeAttention) -> None:
    runner = ModelRunner(load_model(tiny_models["llama"], torch.float32), NUM_BLOCKS, BLOCK_SIZE)
    assert runner.bind_fused() is None  # no native attention kernel (SDPA backend, or none built)
    runner.use_native(native_kernel)
    assert runner.bind_fused() is not None
    float64 = ModelRunner(load_model(tiny_models["llama"], torch.float64), NUM_BLOCKS, BLOCK_SIZE)
    float64.use_native(native_kernel)  # the attention kernel serves float64 ...
    assert float64.native is not None and float64.bind_fused() is None  # ... the layers have no float64 entry
