"""Prepacked linear weights in the engine (workers/engine/packing.py): `on` packs the target, the draft and
the EAGLE head, and greedy output stays token-identical to the unpacked engine and to plain decoding, chains
and trees; `auto` measures bfloat16 models and leaves float32 ones alone; the decision is exported."""

import pytest
import torch
from prometheus_client import CollectorRegistry

from tests.workers.engine_runs import run_all, spec_engine, tokens
from tests.workers.spec.test_engine_eagle import requests
from tests.workers.spec.test_engine_speculation import make_prompts
from workers.engine.interleaved import MAX_PAIRS, MIN_PAIRS
from workers.engine.packing import PackingMode
from workers.models import packed_linear
from workers.worker.engine_metrics import EngineMetrics

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch has no oneDNN")

MODELS = ("target", "draft", "eagle")
# oneDNN's bfloat16 products need AVX-512 BW/VL/DQ or AVX-NE-CONVERT: on AVX2-only hosts bfloat16 stays unpacked
needs_bfloat16_path = pytest.mark.skipif(
    not packed_linear.has_bfloat16_path(),
    reason="this CPU has no oneDNN bfloat16 path: bfloat16 models stay unpacked (test_packing_follows_the_cpu)",
)


def packed_models(engine) -> dict[str, bool]:
    return {name: stats.is_packed for name, stats in engine.packing.items()}


@pytest.fixture(scope="module")
def unpacked_plain(eagle_models) -> dict[str, list[int]]:
    engine = spec_engine(
        eagle_models, eagle="copy_head", speculative_method="none", dtype="bfloat16", linear_packing="off"
    )
    assert packed_models(engine) == dict.fromkeys(MODELS, False)
    return {rid: tokens(o) for rid, o in run_all(engine, requests(make_prompts()[::3])).items()}


@pytest.mark.parametrize(
    "method", [dict(speculative_method="none"), dict(speculative_method="draft"), dict(speculative_method="eagle"),
               dict(speculative_method="eagle", tree_size=5), dict(speculative_method="draft", tree_size=5)],
    ids=["plain", "draft-chain", "eagle-chain", "eagle-tree", "draft-tree"],
)  # fmt: skip
@needs_bfloat16_path
def test_packed_engines_decode_the_unpacked_tokens(eagle_models, unpacked_plain, method) -> None:
    engine = spec_engine(eagle_models, eagle="copy_head", dtype="bfloat16", linear_packing="on", **method)
    assert packed_models(engine) == dict.fromkeys(MODELS, True)
    outs = run_all(engine, requests(make_prompts()[::3]))
    assert {rid: tokens(o) for rid, o in outs.items()} == unpacked_plain
    if method["speculative_method"] != "none":
        assert engine.speculator.stats.counts.num_accepted > 0  # the packed proposers drafted, and were kept


def test_packing_follows_the_cpu(eagle_models, unpacked_plain) -> None:
    """`on` packs a bfloat16 model where the CPU has oneDNN's bfloat16 path; where it has not (AVX2-only), the
    engine starts unpacked, says why and decodes the unpacked tokens, where the reorder used to raise."""
    has_path = packed_linear.has_bfloat16_path()
    engine = spec_engine(eagle_models, eagle="copy_head", speculative_method="none", dtype="bfloat16",
                         linear_packing="on")  # fmt: skip
    assert packed_models(engine) == dict.fromkeys(MODELS, has_path)
    if not has_path:
        assert all("bfloat16 path" in stats.reason for stats in engine.packing.values())
    assert {rid: tokens(o) for rid, o in run_all(engine, requests(make_prompts()[::3])).items()} == unpacked_plain


@needs_bfloat16_path
def test_auto_measures_bfloat16_models(eagle_models) -> None:
    bf16 = spec_engine(eagle_models, eagle="copy_head", dtype="bfloat16", linear_packing="auto")
    for name in MODELS:
        stats = bf16.packing[name]
        assert set(stats.timed_ms) == {"unpacked", "packed"} and all(ms > 0 for ms in stats.timed_ms.values())
        assert MIN_PAIRS <= stats.num_timed_pairs <= MAX_PAIRS
        assert stats.reason.startswith(("faster here", "no clear difference", "slower here", "the packed product's"))
        assert stats.is_packed == stats.reason.startswith(("faster here", "no clear difference"))


def test_auto_leaves_float32_alone(eagle_models) -> None:
    fp32 = spec_engine(eagle_models, eagle="copy_head", dtype="float32", linear_packing=PackingMode.AUTO)
    assert packed_models(fp32) == dict.fromkeys(MODELS, False)
    assert all("bfloat16 models only" in stats.reason for stats in fp32.packing.values())
    assert all(not stats.timed_ms for stats in fp32.packing.values())


@needs_bfloat16_path
def test_the_decision_is_exported_per_model(eagle_models) -> None:
    engine = spec_engine(eagle_models, eagle="copy_head", dtype="bfloat16", linear_packing="on")
    registry = CollectorRegistry()
    EngineMetrics(registry).update(engine, [])
    for name in MODELS:
        assert registry.get_sample_value("specfleet_engine_packed_linears", {"model": name}) == 1.0
    off = spec_engine(eagle_models, eagle="copy_head", dtype="bfloat16", linear_packing="off")
    registry = CollectorRegistry()
    EngineMetrics(registry).update(off, [])
    assert registry.get_sample_value("specfleet_engine_packed_linears", {"model": "target"}) == 0.0
