"""Native decoder layers in the engine (workers/engine/fusing.py): `on` runs the small passes of the target, the
draft and the EAGLE head through them, and greedy output stays token-identical to the unfused engine for plain decoding, chains and
trees; `auto` times each small bucket against the path it would replace; `off` and an SDPA engine bind nothing;
the decision is exported per model and bucket. float64 models have no native layers (spec_engine's default
dtype), so these tests choose float32 or bfloat16."""

import pytest
from prometheus_client import CollectorRegistry

from tests.workers.engine_runs import run_all, spec_engine, tokens
from tests.workers.spec.test_engine_eagle import requests
from tests.workers.spec.test_engine_speculation import make_prompts
from workers.engine.compile_stats import Bucket
from workers.worker.engine_metrics import EngineMetrics

SMALL_BUCKETS = {Bucket.DECODE, Bucket.SMALL}  # the engine's default thread policy: one thread up to 4 tokens


MODELS = ("target", "draft", "eagle")


def fused_buckets(engine) -> dict[str, frozenset[Bucket]]:
    runners = {"target": engine.runner, "draft": engine.speculator.draft.runner, "eagle": engine.speculator.eagle.runner}
    return {name: runner.fused_buckets for name, runner in runners.items()}


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def unfused_plain(request, eagle_models) -> tuple[str, dict[str, list[int]]]:
    dtype = request.param
    engine = spec_engine(eagle_models, eagle="copy_head", speculative_method="none", dtype=dtype, fused_layers="off")
    assert fused_buckets(engine) == dict.fromkeys(MODELS, frozenset())
    return dtype, {rid: tokens(o) for rid, o in run_all(engine, requests(make_prompts()[::3])).items()}


@pytest.mark.parametrize(
    "method", [dict(speculative_method="none"), dict(speculative_method="draft"), dict(speculative_method="eagle"),
               dict(speculative_method="eagle", tree_size=5), dict(speculative_method="draft", tree_size=5)],
    ids=["plain", "draft-chain", "eagle-chain", "eagle-tree", "draft-tree"],
)  # fmt: skip
def test_fused_engines_decode_the_unfused_tokens(eagle_models, unfused_plain, method) -> None:
    dtype, want = unfused_plain
    engine = spec_engine(eagle_models, eagle="copy_head", dtype=dtype, fused_layers="on", **method)
    assert fused_buckets(engine) == dict.fromkeys(MODELS, frozenset(SMALL_BUCKETS))
    outs = run_all(engine, requests(make_prompts()[::3]))
    assert {rid: tokens(o) for rid, o in outs.items()} == want
    if method["speculative_method"] != "none":
        assert engine.speculator.stats.counts.num_accepted > 0  # the fused proposers drafted, and were kept


def test_auto_times_each_small_bucket(eagle_models) -> None:
    engine = spec_engine(eagle_models, eagle="copy_head", dtype="bfloat16", fused_layers="auto")
    for name, buckets in fused_buckets(engine).items():
        stats = engine.fusing[name]
        assert set(stats.timed_ms) == {b.value for b in SMALL_BUCKETS}
        for bucket in SMALL_BUCKETS:
            timed = stats.timed_ms[bucket.value]
            assert set(timed) == {"unfused", "fused"} and all(ms > 0 for ms in timed.values())
            reason = stats.reasons[bucket.value]
            assert reason.startswith(("faster here", "not faster here", "chose another token"))
            assert stats.is_fused[bucket.value] == reason.startswith("faster here") == (bucket in buckets)
        assert not stats.is_fused[Bucket.BATCH.value]


def test_off_and_sdpa_engines_bind_nothing(eagle_models) -> None:
    off = spec_engine(eagle_models, eagle="copy_head", dtype="float32", fused_layers="off")
    sdpa = spec_engine(eagle_models, eagle="copy_head", dtype="float32", fused_layers="on", attention_backend="sdpa")
    for engine, why in ((off, "off"), (sdpa, "needs the native kernel")):
        assert fused_buckets(engine) == dict.fromkeys(MODELS, frozenset())
        assert engine.runner.fused is None
        for stats in engine.fusing.values():
            assert not any(stats.is_fused.values()) and not stats.timed_ms
            assert all(reason.startswith(why) for reason in stats.reasons.values())


def test_the_decision_is_exported_per_model_and_bucket(eagle_models) -> None:
    engine = spec_engine(eagle_models, eagle="copy_head", dtype="float32", fused_layers="on")
    registry = CollectorRegistry()
    EngineMetrics(registry).update(engine, [])
    for name in MODELS:
        for bucket in Bucket:
            value = registry.get_sample_value("specfleet_engine_fused_layers", {"model": name, "bucket": bucket.value})
            assert value == float(bucket in SMALL_BUCKETS)
