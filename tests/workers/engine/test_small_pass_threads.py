"""Threads of small passes (workers/engine/small_pass_threads.py): `one` keeps them on one thread, `all` gives
them every thread where a model's passes take the native layers (and only there), `auto` decides from paired
passes and says why; the tokens are the same whichever it chose, and the choice is exported per model."""

import pytest
from prometheus_client import CollectorRegistry

from tests.workers.engine_runs import run_all, spec_engine, tokens
from tests.workers.spec.test_engine_eagle import requests
from tests.workers.spec.test_engine_speculation import make_prompts
from workers.worker.engine_metrics import EngineMetrics

MODELS = ("target", "draft", "eagle")
TWO_THREADS = dict(num_threads=2, dtype="float32")  # a small pass may take 2 threads on any host (CI has 2 cores)


def runners(engine) -> dict:
    return {"target": engine.runner, "draft": engine.speculator.draft.runner, "eagle": engine.speculator.eagle.runner}


def small_pass_limits(engine) -> dict[str, int]:
    """Each runner's thread policy: passes of at most this many tokens run on one thread."""
    return {name: runner.threads.single_thread_max_tokens for name, runner in runners(engine).items()}


def test_one_keeps_small_passes_on_one_thread(eagle_models) -> None:
    engine = spec_engine(eagle_models, eagle="copy_head", fused_layers="on", small_pass_threads="one", **TWO_THREADS)
    assert small_pass_limits(engine) == dict.fromkeys(MODELS, engine.cfg.single_thread_max_tokens)
    for choice in engine.small_pass_threads.values():
        assert (choice.num_threads, choice.reason, choice.timed_ms) == (1, "one", {})


def test_all_threads_only_where_the_passes_take_the_native_layers(eagle_models) -> None:
    fused = spec_engine(eagle_models, eagle="copy_head", fused_layers="on", small_pass_threads="all", **TWO_THREADS)
    assert small_pass_limits(fused) == dict.fromkeys(MODELS, 0)
    assert {name: c.num_threads for name, c in fused.small_pass_threads.items()} == dict.fromkeys(MODELS, 2)

    op_by_op = spec_engine(eagle_models, eagle="copy_head", fused_layers="off", small_pass_threads="all", **TWO_THREADS)
    assert small_pass_limits(op_by_op) == dict.fromkeys(MODELS, op_by_op.cfg.single_thread_max_tokens)
    for choice in op_by_op.small_pass_threads.values():
        assert choice.num_threads == 1 and choice.reason.startswith("its small passes go op by op")


def test_one_thread_engines_have_nothing_to_choose(eagle_models) -> None:
    engine = spec_engine(eagle_models, eagle="copy_head", dtype="float32", fused_layers="on", num_threads=1)
    for choice in engine.small_pass_threads.values():
        assert choice.num_threads == 1 and choice.reason == "every pass already runs on the same threads"
        assert not choice.timed_ms


def test_auto_decides_from_paired_passes_and_says_why(eagle_models) -> None:
    engine = spec_engine(eagle_models, eagle="copy_head", fused_layers="on", **TWO_THREADS)
    limit = engine.cfg.single_thread_max_tokens
    for name, runner in runners(engine).items():
        choice = engine.small_pass_threads[name]
        assert list(choice.timed_ms) in ([1], [1, limit])  # a loss at one token ends the search
        for ms in choice.timed_ms.values():
            assert set(ms) == {"one", "all"} and all(v > 0 for v in ms.values())
        if choice.num_threads == 2:
            assert list(choice.timed_ms) == [1, limit] and "and in all" in choice.reason
            assert sum(ms["all"] for ms in choice.timed_ms.values()) <= sum(ms["one"] for ms in choice.timed_ms.values())
            assert runner.threads.single_thread_max_tokens == 0
        else:
            assert choice.num_threads == 1 and runner.threads.single_thread_max_tokens == limit
            assert choice.reason.startswith("all threads not faster at one token") or "slower in all" in choice.reason


@pytest.mark.parametrize(
    "method", [dict(speculative_method="none"), dict(speculative_method="eagle"),
               dict(speculative_method="draft", tree_size=5)],
    ids=["plain", "eagle-chain", "draft-tree"],
)  # fmt: skip
def test_the_tokens_do_not_depend_on_the_choice(eagle_models, method) -> None:
    """Decode steps, draft tokens and short chains on all threads: the products split outputs and attention
    splits whole heads, so every row has the bits it has on one thread."""
    outs = {}
    for mode in ("one", "all"):
        engine = spec_engine(eagle_models, eagle="copy_head", fused_layers="on", small_pass_threads=mode, **TWO_THREADS,
                             **method)  # fmt: skip
        outs[mode] = {rid: tokens(o) for rid, o in run_all(engine, requests(make_prompts()[::3])).items()}
    assert outs["all"] == outs["one"] and all(outs["one"].values())


def test_the_choice_is_exported_per_model(eagle_models) -> None:
    for mode, want in (("one", 1.0), ("all", 2.0)):
        engine = spec_engine(eagle_models, eagle="copy_head", fused_layers="on", small_pass_threads=mode, **TWO_THREADS)
        registry = CollectorRegistry()
        EngineMetrics(registry).update(engine, [])
        for name in MODELS:
            assert registry.get_sample_value("specfleet_engine_small_pass_threads", {"model": name}) == want
