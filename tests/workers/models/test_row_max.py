"""The native row maximum (NativeAttention.row_max, workers/models/row_max.cpp): the same maxima and indices as
torch.max(rows, dim=-1) on rows full of ties, NaN, infinities and signed zeros, at every width around its
vector blocks, on strided rows and on every build; what it hands back to torch; and the engine's greedy tokens
through it."""

import math
from pathlib import Path

import pytest
import torch

from tests.helpers.models import HAS_SEPARATE_AVX2_BUILD
from workers.engine.config import EngineConfig
from workers.engine.engine import Engine
from workers.engine.sampling_params import SamplingParams
from workers.models.native_attention import NativeAttention
from workers.spec.row_max import torch_row_max

WIDTHS = [1, 2, 15, 16, 17, 63, 64, 65, 127, 128, 129, 200, 4096, 4097]  # around the 16-lane vector, 64-wide block


def special_rows(num_cols: int, kind: str, seed: int) -> torch.Tensor:  # [6, num_cols] float32
    """Small integers (many ties), then one kind of value sprinkled in."""
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randint(-3, 3, (6, num_cols), generator=gen).float()
    sprinkled = torch.rand(rows.shape, generator=gen) < 0.05
    if kind == "nan":
        rows[sprinkled] = float("nan")
        rows[1, -1] = float("nan")  # in the tail past the last vector block
        rows[2, 0] = float("nan")
    elif kind == "inf":
        rows[sprinkled] = float("inf")
    elif kind == "minus_inf":
        rows.fill_(float("-inf"))
        rows[1:3, -1] = 0.0
    elif kind == "signed_zeros":  # -0.0 == 0.0: the first of them wins, with its own sign
        rows = torch.where(rows >= 0, torch.where(sprinkled, 0.0, -0.0), rows)
    elif kind == "tail_max":
        rows[:, -1] = 5.0
    return rows


def same_answer(got: tuple[list[float], list[int]], want: tuple[list[float], list[int]]) -> bool:
    (got_max, got_index), (want_max, want_index) = got, want
    same_values = all(
        (math.isnan(a) and math.isnan(b)) or (a == b and math.copysign(1, a) == math.copysign(1, b))
        for a, b in zip(got_max, want_max, strict=True)
    )
    return got_index == want_index and same_values


@pytest.fixture(params=["native", *(["avx2"] if HAS_SEPARATE_AVX2_BUILD else [])])
def kernel(request: pytest.FixtureRequest, native_kernel: NativeAttention) -> NativeAttention:
    """This host's build and, on AVX-512 hosts, the AVX2 one (16-lane vectors as two 8-lane halves)."""
    return native_kernel if request.param == "native" else request.getfixturevalue("avx2_kernel")


@pytest.mark.parametrize("num_cols", WIDTHS)
@pytest.mark.parametrize("kind", ["ties", "nan", "inf", "minus_inf", "signed_zeros", "tail_max"])
def test_native_row_max_answers_as_torch_max(kernel: NativeAttention, num_cols: int, kind: str) -> None:
    for seed in range(4):
        rows = special_rows(num_cols, kind, seed)
        assert same_answer(kernel.row_max(rows), torch_row_max(rows)), (kind, num_cols, seed)
        if num_cols > 1:  # rows further apart than their width: a slice of wider rows
            part = rows[:, : num_cols // 2 + 1]
            assert part.stride(0) == num_cols
            assert same_answer(kernel.row_max(part), torch_row_max(part)), (kind, num_cols, seed)


def test_random_logits_rows(kernel: NativeAttention) -> None:
    gen = torch.Generator().manual_seed(7)
    for num_rows in (1, 3, 16, 33):
        rows = torch.randn(num_rows, 4096, generator=gen) * 10
        maxima, indices = kernel.row_max(rows)
        assert indices == rows.argmax(dim=-1).tolist()
        assert maxima == rows.amax(dim=-1).tolist()


def test_what_the_kernel_does_not_read_goes_to_torch(native_kernel: NativeAttention) -> None:
    """bfloat16 rows, rows whose elements are apart (a transposed view) and an empty row axis get torch's answer:
    the same values, and torch's error for rows with nothing in them."""
    gen = torch.Generator().manual_seed(1)
    rows = torch.randint(-3, 3, (5, 40), generator=gen).float()
    for other in (rows.bfloat16(), rows.t(), torch.zeros(0, 7)):
        assert same_answer(native_kernel.row_max(other), torch_row_max(other))
    with pytest.raises(IndexError):
        native_kernel.row_max(torch.zeros(3, 0))


def test_the_engine_takes_its_greedy_tokens_from_the_native_rows(
    tiny_pair: tuple[Path, Path], native_kernel: NativeAttention, tmp_path: Path
) -> None:
    """Verification (the target's argmax) and the draft's greedy chains read the native row maximum, and give
    the same tokens as with torch's."""
    target, draft = tiny_pair
    cfg = EngineConfig(dtype="float32", max_num_seqs=4, kv_cache_mb=8, compile_cache_dir=str(tmp_path),
                       speculative_method="draft", is_adaptive=False, num_speculative_tokens=3)  # fmt: skip
    engine = Engine(cfg, target, draft)
    speculator = engine.speculator
    assert speculator.draft is not None
    for row_max in (speculator.row_max, speculator.draft.row_max):
        assert isinstance(getattr(row_max, "__self__", None), NativeAttention)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outputs = []
    for row_max in (speculator.row_max, torch_row_max):
        speculator.row_max = speculator.draft.row_max = row_max
        for i, prompt in enumerate([[5, 6, 7, 8], [9, 10], [11, 12, 13]]):
            engine.add_request(f"{len(outputs)}-{i}", prompt, params)
        tokens: dict[str, list[int]] = {}
        while engine.num_unfinished():
            for out in engine.step():
                tokens.setdefault(out.request_id.split("-")[1], []).extend(out.new_token_ids)
        outputs.append(tokens)
    assert speculator.stats.counts.num_drafted > 0
    assert outputs[0] == outputs[1]
    assert all(len(t) == 12 for t in outputs[0].values())
