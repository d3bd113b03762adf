"""Native decoder layers in the engine (workers/engine/fusing.py): `on` runs every pass of the target, the draft
and the EAGLE head through them, and greedy output stays token-identical to the unfused engine for plain
decoding, chains and trees; `auto` times passes of every size against the path they would replace and serves all
of them or none; `off` and an SDPA engine bind nothing; the decision is exported per model. float64
models have no native layers (spec_engine's default dtype), so these tests choose float32 or bfloat16."""

import pytest
from prometheus_client import CollectorRegistry

from tests.workers.engine_runs import run_all, spec_engine, tokens
from tests.workers.spec.test_engine_eagle import requests
from tests.workers.spec.test_engine_speculation import make_prompts
from workers.engine.fusing import pass_sizes
from workers.worker.engine_metrics import EngineMetrics

MODELS = ("target", "draft", "eagle")


def runners(engine) -> dict:
    return {"target": engine.runner, "draft": engine.speculator.draft.runner, "eagle": engine.speculator.eagle.runner}


def fused_max_tokens(engine) -> dict[str, int]:
    return {name: runner.fused_max_tokens for name, runner in runners(engine).items()}


def largest_pass(engine) -> int:
    """What the engine lets the layers serve at most: its largest pass, within its cache and model length."""
    cfg = engine.cfg
    return min(cfg.max_num_batched_tokens, engine.block_manager.num_blocks * cfg.block_size, engine.max_model_len)


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def unfused_plain(request, eagle_models) -> tuple[str, dict[str, list[int]]]:
    dtype = request.param
    engine = spec_engine(eagle_models, eagle="copy_head", speculative_method="none", dtype=dtype, fused_layers="off")
    assert fused_max_tokens(engine) == dict.fromkeys(MODELS, 0)
    return dtype, {rid: tokens(o) for rid, o in run_all(engine, requests(make_prompts()[::3])).items()}


@pytest.mark.parametrize(
    "method", [dict(speculative_method="none"), dict(speculative_method="draft"), dict(speculative_method="eagle"),
               dict(speculative_method="eagle", tree_size=5), dict(speculative_method="draft", tree_size=5)],
    ids=["plain", "draft-chain", "eagle-chain", "eagle-tree", "draft-tree"],
)  # fmt: skip
def test_fused_engines_decode_the_unfused_tokens(eagle_models, unfused_plain, method) -> None:
    """Every pass (prefill chunks, decode batches, chains, trees) through the native layers."""
    dtype, want = unfused_plain
    engine = spec_engine(eagle_models, eagle="copy_head", dtype=dtype, fused_layers="on", **method)
    assert fused_max_tokens(engine) == dict.fromkeys(MODELS, largest_pass(engine))
    outs = run_all(engine, requests(make_prompts()[::3]))
    assert {rid: tokens(o) for rid, o in outs.items()} == want
    if method["speculative_method"] != "none":
        assert engine.speculator.stats.counts.num_accepted > 0  # the fused proposers drafted, and were kept


def test_auto_serves_every_pass_or_none(eagle_models) -> None:
    # small passes pinned to one thread: `auto` there runs after fusing's choice and, where all threads win on
    # this host, sets the runners' single-thread limit to 0, which would change what pass_sizes reads back below
    engine = spec_engine(
        eagle_models, eagle="copy_head", dtype="bfloat16", fused_layers="auto", small_pass_threads="one"
    )
    for name, runner in runners(engine).items():
        stats = engine.fusing[name]
        sizes = pass_sizes(runner, largest_pass(engine))
        assert sizes[:3] == [1, engine.cfg.single_thread_max_tokens, 2 * engine.cfg.single_thread_max_tokens]
        timed = list(stats.timed_ms)
        assert timed == sizes[: len(timed)] and timed  # in order, from one token
        for ms in stats.timed_ms.values():
            assert set(ms) == {"unfused", "fused"} and all(v > 0 for v in ms.values())
        assert runner.fused_max_tokens == stats.max_tokens in (0, largest_pass(engine))  # all or nothing
        if stats.max_tokens:
            assert timed == sizes and stats.reason.startswith("faster at one token") and "and in all" in stats.reason
            assert sum(ms["fused"] for ms in stats.timed_ms.values()) <= sum(
                ms["unfused"] for ms in stats.timed_ms.values()
            )
        else:
            assert stats.reason.startswith(("not faster at one token", "at ")) or "slower in all" in stats.reason


def test_off_and_sdpa_engines_bind_nothing(eagle_models) -> None:
    off = spec_engine(eagle_models, eagle="copy_head", dtype="float32", fused_layers="off")
    sdpa = spec_engine(eagle_models, eagle="copy_head", dtype="float32", fused_layers="on", attention_backend="sdpa")
    for engine, why in ((off, "off"), (sdpa, "needs the native kernel")):
        assert fused_max_tokens(engine) == dict.fromkeys(MODELS, 0)
        assert all(runner.fused is None for runner in runners(engine).values())
        for stats in engine.fusing.values():
            assert stats.max_tokens == 0 and not stats.timed_ms and stats.reason.startswith(why)


def test_the_decision_is_exported_per_model(eagle_models) -> None:
    for mode in ("on", "off"):
        engine = spec_engine(eagle_models, eagle="copy_head", dtype="float32", fused_layers=mode)
        registry = CollectorRegistry()
        EngineMetrics(registry).update(engine, [])
        for name in MODELS:
            value = registry.get_sample_value("specfleet_engine_fused_max_tokens", {"model": name})
            assert value == (largest_pass(engine) if mode == "on" else 0)
