"""The native paged-attention kernel (workers/models/native_attention.py) against the SDPA path it replaces,
token trees included, and what happens where it cannot serve: trees too wide for its bitmasks, float16, no
compiler, a failing build."""

import logging
import os
from pathlib import Path

import pytest
import torch

from workers.engine.model_runner import ForwardItem, ModelRunner, build_batch
from workers.models.attention import attend_paged
from workers.models.loader import load_model
from workers.models.native_attention import NativeAttention, load
from workers.models.threads import pinned_threads

BLOCK_SIZE = 4
NUM_BLOCKS = 24
HEAD_DIM = 16
NUM_HEADS = 4
TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 3e-2}


def ragged_items() -> list[ForwardItem]:
    """Decodes, a chain to verify and a prefill chunk, over scattered (descending, shared-free) blocks."""
    return [
        ForwardItem([1], start_pos=9, block_table=[23, 4, 17], num_logits=1),
        ForwardItem([1, 2, 3], start_pos=5, block_table=[2, 20], num_logits=3),
        ForwardItem([1] * 7, start_pos=6, block_table=[15, 9, 12, 6], num_logits=1),
        ForwardItem([1], start_pos=0, block_table=[0], num_logits=1),
    ]


def random_pass(
    dtype: torch.dtype,
    num_kv_heads: int,
    num_tokens: int,
    seed: int = 0,
    num_blocks: int = NUM_BLOCKS,
    num_heads: int = NUM_HEADS,
    head_dim: int = HEAD_DIM,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q [T, H, D], k [T, KV, D], v [T, KV, D], k_cache, v_cache [num_blocks, BLOCK_SIZE, KV, D])."""
    gen = torch.Generator().manual_seed(seed)
    cache_shape = (num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)

    qkv = randn(num_tokens, num_heads + 2 * num_kv_heads, head_dim)  # q, k, v as strided views, as the model has
    q, k, v = qkv.split([num_heads, num_kv_heads, num_kv_heads], dim=1)
    return q, k, v, randn(*cache_shape), randn(*cache_shape)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_kv_heads", [NUM_HEADS, 2])  # MHA, GQA
@pytest.mark.parametrize("sliding_window", [None, 5])
def test_native_attention_equals_the_sdpa_path(
    native_kernel: NativeAttention, dtype: torch.dtype, num_kv_heads: int, sliding_window: int | None
) -> None:
    items = ragged_items()
    num_tokens = sum(len(it.token_ids) for it in items)
    q, k, v, k_cache, v_cache = random_pass(dtype, num_kv_heads, num_tokens)
    sdpa_meta = build_batch(items, BLOCK_SIZE, sliding_window).meta
    native_meta = build_batch(items, BLOCK_SIZE, sliding_window, native_kernel).meta
    assert native_meta.native is native_kernel and native_meta.mask is None
    k_native, v_native = k_cache.clone(), v_cache.clone()

    expected = attend_paged(q, k, v, k_cache, v_cache, sdpa_meta, HEAD_DIM**-0.5)  # [T, H * D]
    got = attend_paged(q, k, v, k_native, v_native, native_meta, HEAD_DIM**-0.5)  # [T, H * D]

    assert got.shape == (num_tokens, NUM_HEADS * HEAD_DIM) and got.dtype == dtype
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got, expected, atol=tol, rtol=tol)
    assert torch.equal(k_native, k_cache) and torch.equal(v_native, v_cache)  # the same slots written


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_kv_heads", [NUM_HEADS, 2])  # MHA, GQA
@pytest.mark.parametrize("sliding_window", [None, 40])
def test_runs_over_more_keys_than_a_value_tile_equal_the_sdpa_path(
    native_kernel: NativeAttention, dtype: torch.dtype, num_kv_heads: int, sliding_window: int | None
) -> None:
    """Past 32 keys (paged_attention.cpp's kTileKeys: a run whose rows several (token, head) pairs read sums its
    values a tile of keys at a time): a chain to verify and a decode, each over three tiles' worth of keys."""
    items = [
        ForwardItem([1, 2, 3, 4, 5], start_pos=70, block_table=list(range(40, 59)), num_logits=5),
        ForwardItem([1], start_pos=90, block_table=list(range(23)), num_logits=1),
    ]
    q, k, v, k_cache, v_cache = random_pass(dtype, num_kv_heads, 6, num_blocks=60)
    sdpa_meta = build_batch(items, BLOCK_SIZE, sliding_window).meta
    native_meta = build_batch(items, BLOCK_SIZE, sliding_window, native_kernel).meta
    assert native_meta.native is native_kernel

    expected = attend_paged(q, k, v, k_cache.clone(), v_cache.clone(), sdpa_meta, HEAD_DIM**-0.5)  # [T, H * D]
    got = attend_paged(q, k, v, k_cache, v_cache, native_meta, HEAD_DIM**-0.5)  # [T, H * D]

    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got, expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("num_heads", "head_dim"), [(NUM_HEADS, HEAD_DIM), (6, 64), (3, 128)])
def test_a_token_gets_the_same_bits_alone_or_inside_a_longer_pass(
    native_kernel: NativeAttention, dtype: torch.dtype, num_heads: int, head_dim: int
) -> None:
    """Position 13 verified as the last of a 4-token chain, or decoded alone after the other three: equal
    bits (what speculative decoding's greedy output relies on in attention). Alone, a token's value sums go
    a few heads at a time in registers (paged_attention.cpp, add_values_by_pair): 16 / (head_dim / 16) heads
    to a group, so 64-element heads fill a group of 4 and leave 2, 128-element heads go one by one."""
    table = [7, 3, 11, 1]
    q, k, v, k_cache, v_cache = random_pass(dtype, num_heads, 4, seed=1, num_heads=num_heads, head_dim=head_dim)
    chain_cache = (k_cache.clone(), v_cache.clone())
    chain = build_batch([ForwardItem([1] * 4, 10, table, 4)], BLOCK_SIZE, None, native_kernel).meta
    in_chain = attend_paged(q, k, v, *chain_cache, chain, 1.0)[3]  # [H * D]

    first_three = build_batch([ForwardItem([1] * 3, 10, table, 3)], BLOCK_SIZE, None, native_kernel).meta
    attend_paged(q[:3], k[:3], v[:3], k_cache, v_cache, first_three, 1.0)
    decode = build_batch([ForwardItem([1], 13, table, 1)], BLOCK_SIZE, None, native_kernel).meta
    alone = attend_paged(q[3:], k[3:], v[3:], k_cache, v_cache, decode, 1.0)[0]  # [H * D]

    assert torch.equal(in_chain, alone)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_kv_heads", [NUM_HEADS, 2])  # MHA, GQA
@pytest.mark.parametrize("items", [ragged_items()[:1], ragged_items()[1:2], ragged_items()], ids=["decode", "chain", "ragged"])
def test_the_bits_do_not_depend_on_the_thread_count(
    native_kernel: NativeAttention, dtype: torch.dtype, num_kv_heads: int, items: list[ForwardItem]
) -> None:
    """One sequence's pass splits its heads over the threads (each part whole KV heads); more runs than threads
    spread by run: every (token, head) is computed the same way whichever thread and part it falls in."""
    num_tokens = sum(len(it.token_ids) for it in items)
    q, k, v, k_cache, v_cache = random_pass(dtype, num_kv_heads, num_tokens, seed=2)
    meta = build_batch(items, BLOCK_SIZE, None, native_kernel).meta
    outs = []
    for num_threads in (1, 2, 3, 4):
        with pinned_threads(num_threads):
            outs.append(attend_paged(q, k, v, k_cache.clone(), v_cache.clone(), meta, HEAD_DIM**-0.5))  # [T, H * D]
    assert all(torch.equal(out, outs[0]) for out in outs[1:])
    assert not outs[0].isnan().any()


def tree_items() -> list[ForwardItem]:
    """A verify pass over a 4-node tree (root's last token, then the nodes: 1 and 2 children of the root, 3 a
    child of 1), and a proposer's frontier pass (nodes 2 and 3 of a tree whose slots start at 7)."""
    ancestors = torch.tensor([[1, 0, 0, 0], [0, 1, 0, 0], [1, 0, 1, 0], [0, 1, 0, 1]], dtype=torch.bool)  # [4, 4]
    verify = ForwardItem([1, 2, 3, 4, 5], start_pos=6, block_table=[13, 21, 3], num_logits=5,
                         positions=[6, 7, 7, 8, 8], tree_start=7,
                         tree_mask=torch.cat([torch.zeros(1, 4, dtype=torch.bool), ancestors]))
    frontier = ForwardItem([6, 7], start_pos=9, block_table=[8, 19, 22], num_logits=2, positions=[8, 9],
                           tree_start=7, tree_mask=ancestors[2:])
    return [verify, frontier]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sliding_window", [None, 5])
def test_token_trees_through_the_kernel_equal_the_sdpa_path(
    native_kernel: NativeAttention, dtype: torch.dtype, sliding_window: int | None
) -> None:
    items = [*ragged_items()[:2], *tree_items()]
    num_tokens = sum(len(it.token_ids) for it in items)
    q, k, v, k_cache, v_cache = random_pass(dtype, 2, num_tokens, seed=2)
    sdpa_meta = build_batch(items, BLOCK_SIZE, sliding_window).meta
    native_meta = build_batch(items, BLOCK_SIZE, sliding_window, native_kernel).meta
    assert native_meta.native is native_kernel and native_meta.tree_bits is not None
    assert native_meta.tree_bits.tolist()[-7:] == [0, 0b0001, 0b0010, 0b0101, 0b1010, 0b0101, 0b1010]
    k_native, v_native = k_cache.clone(), v_cache.clone()

    expected = attend_paged(q, k, v, k_cache, v_cache, sdpa_meta, HEAD_DIM**-0.5)
    got = attend_paged(q, k, v, k_native, v_native, native_meta, HEAD_DIM**-0.5)

    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got, expected, atol=tol, rtol=tol)
    assert torch.equal(k_native, k_cache) and torch.equal(v_native, v_cache)


def test_trees_the_bitmasks_cannot_hold_take_the_sdpa_path(native_kernel: NativeAttention) -> None:
    nodes = torch.eye(64, dtype=torch.bool)  # 64 tree slots, each node its own: one more than a bitmask holds
    wide = torch.cat([torch.zeros(1, 64, dtype=torch.bool), nodes])  # [65, 64]: the root's row, then the nodes
    big = ForwardItem([1] * 65, start_pos=4, block_table=list(range(NUM_BLOCKS)), num_logits=65, tree_start=5,
                      tree_mask=wide)
    meta = build_batch([*ragged_items(), big], BLOCK_SIZE, None, native_kernel).meta
    assert meta.native is None and meta.mask is not None

    small = build_batch([*ragged_items(), *tree_items()], BLOCK_SIZE, None, native_kernel).meta
    assert small.native is native_kernel and small.mask is None


def test_float16_models_stay_on_sdpa(native_kernel: NativeAttention, tiny_target: Path) -> None:
    runner = ModelRunner(load_model(tiny_target, torch.float16), num_blocks=8, block_size=BLOCK_SIZE)
    runner.use_native(native_kernel)
    assert runner.native is None
    runner32 = ModelRunner(load_model(tiny_target, torch.float32), num_blocks=8, block_size=BLOCK_SIZE)
    runner32.use_native(native_kernel)
    assert runner32.native is native_kernel


def test_without_a_compiler_attention_stays_on_sdpa(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    empty = tmp_path / "empty-path"
    empty.mkdir()
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setenv("PATH", str(empty))
    with caplog.at_level(logging.WARNING):
        assert load(tmp_path / "cache") is None
    assert "no C++ compiler" in caplog.text


def test_a_failing_build_leaves_attention_on_sdpa(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    broken = tmp_path / "broken-cxx"
    broken.write_text("#!/bin/sh\necho 'internal compiler error: simulated' >&2\nexit 1\n")
    broken.chmod(0o755)
    monkeypatch.setenv("CXX", str(broken))
    with caplog.at_level(logging.WARNING):
        assert load(tmp_path / "cache") is None
    assert "simulated" in caplog.text
    assert not any(name.endswith(".so") for name in os.listdir(tmp_path / "cache"))  # nothing half-written kept
