"""The EAGLE head inside the engine, on a one-layer tiny target in float64 (and bfloat16): exactness of chains
and trees alone and in mixed batches, features kept across preemption, fallback, refusals, per-method metrics.

copy_head drafts what the target would mostly (deep acceptance, the accepted-feature paths); random_head
hardly ever (rejections): greedy output must equal plain decoding for any head."""

import json
import shutil
from pathlib import Path

import pytest

from shared.speculation import SpeculativeMethod
from tests.workers.engine_runs import greedy, run_all, spec_engine, tokens
from tests.workers.spec.test_engine_speculation import make_prompts
from workers.engine.errors import InvalidRequestError
from workers.engine.sampling_params import SamplingParams
from workers.models.eagle_head import HeadMismatchError

EAGLE_CONFIGS = {
    "eagle-chain": dict(speculative_method="eagle", eagle="copy_head"),
    "eagle-chain-fixed-k": dict(speculative_method="eagle", eagle="copy_head", is_adaptive=False),
    "eagle-tree": dict(speculative_method="eagle", eagle="copy_head", tree_size=6, tree_branching=2),
    "random-head-tree": dict(
        speculative_method="eagle", eagle="random_head", tree_size=5, is_adaptive=False,
    ),
    # a draft vocabulary of the even ids: chains end at an odd token the target would take
    "draft-vocab-chain": dict(speculative_method="eagle", eagle="vocab_head", is_adaptive=False),
    "draft-vocab-tree": dict(speculative_method="eagle", eagle="vocab_head", tree_size=6, tree_branching=2),
}


def requests(prompts: list[list[int]], **kw) -> dict[str, tuple[list[int], SamplingParams]]:
    return {str(i): (p, greedy(24 + i % 9, **kw)) for i, p in enumerate(prompts)}


@pytest.fixture(scope="module")
def plain(eagle_models: dict[str, Path]) -> dict[str, list[int]]:
    engine = spec_engine(eagle_models, draft=None, speculative_method="none")
    return {rid: tokens(o) for rid, o in run_all(engine, requests(make_prompts())).items()}


def test_an_engine_holding_a_head_speculates_with_it_unless_told_otherwise(eagle_models, plain) -> None:
    engine = spec_engine(eagle_models, eagle="copy_head", speculative_method=None)  # a draft model too
    assert engine.cfg.speculative_method is SpeculativeMethod.EAGLE
    outs = run_all(engine, requests(make_prompts()[:2]))
    assert {rid: tokens(o) for rid, o in outs.items()} == {rid: plain[rid] for rid in outs}
    assert engine.speculator.stats.methods[SpeculativeMethod.EAGLE].counts.num_steps > 0
    assert SpeculativeMethod.DRAFT not in engine.speculator.stats.methods
    assert spec_engine(eagle_models, speculative_method=None).cfg.speculative_method is SpeculativeMethod.DRAFT


@pytest.mark.parametrize("name", EAGLE_CONFIGS)
def test_greedy_eagle_equals_plain_decoding_in_a_batch(eagle_models, plain, name) -> None:
    engine = spec_engine(eagle_models, draft=None, **EAGLE_CONFIGS[name])
    outs = run_all(engine, requests(make_prompts()))
    assert {rid: tokens(o) for rid, o in outs.items()} == plain
    stats = engine.speculator.stats
    assert stats.counts.num_steps > 0 and stats.num_fallbacks == 0
    if "random" not in name:
        assert stats.counts.num_accepted > 0  # the trained head really drafted, and was right sometimes


@pytest.mark.parametrize("name", ["eagle-chain", "eagle-tree"])
def test_greedy_eagle_equals_plain_decoding_alone(eagle_models, plain, name) -> None:
    engine = spec_engine(eagle_models, draft=None, **EAGLE_CONFIGS[name])
    for i, p in list(enumerate(make_prompts()))[::6]:
        rid = str(i)
        assert tokens(run_all(engine, {rid: (p, greedy(24 + i % 9))})[rid]) == plain[rid]


@pytest.mark.parametrize("tree_size", [0, 6])
def test_mixed_batch_eagle_beside_draft_ngram_and_none(eagle_models, plain, tree_size) -> None:
    engine = spec_engine(eagle_models, eagle="copy_head", tree_size=tree_size)
    choices = [None, "none", "ngram", "draft", "eagle", "eagle"]
    reqs = {
        str(i): (p, greedy(24 + i % 9, speculative=choices[i % len(choices)])) for i, p in enumerate(make_prompts())
    }
    outs = run_all(engine, reqs)
    assert {rid: tokens(o) for rid, o in outs.items()} == plain
    methods = engine.speculator.stats.methods
    assert methods[SpeculativeMethod.EAGLE].counts.num_accepted > 0
    assert methods[SpeculativeMethod.DRAFT].counts.num_steps > 0 and methods[SpeculativeMethod.EAGLE].draft_time_s > 0


def test_eagle_survives_preemption_and_chunked_prefill(eagle_models, plain) -> None:
    """A small KV budget preempts sequences (their features are dropped and recomputed) and a small token
    budget splits prompts into chunks (features kept chunk by chunk): still token-identical."""
    engine = spec_engine(
        eagle_models, draft=None, eagle="copy_head", speculative_method="eagle", kv_cache_mb=0.15,
        max_num_batched_tokens=16,
    )  # fmt: skip
    outs = run_all(engine, requests(make_prompts()))
    assert {rid: tokens(o) for rid, o in outs.items()} == plain
    assert sum(o[-1].metrics["num_preemptions"] for o in outs.values()) > 0
    assert engine.speculator.stats.counts.num_accepted > 0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_eagle_equals_plain_decoding_in_the_serving_dtypes(eagle_models, dtype) -> None:
    prompts = make_prompts()[::4]
    ref = run_all(spec_engine(eagle_models, draft=None, speculative_method="none", dtype=dtype), requests(prompts))
    for head, tree_size in (("copy_head", 0), ("copy_head", 5), ("vocab_head", 0), ("vocab_head", 5)):
        engine = spec_engine(
            eagle_models, draft=None, eagle=head, speculative_method="eagle", dtype=dtype, tree_size=tree_size,
        )  # fmt: skip
        outs = run_all(engine, requests(prompts))
        assert {rid: tokens(o) for rid, o in outs.items()} == {rid: tokens(o) for rid, o in ref.items()}


def test_compiled_eagle_equals_plain_decoding_and_is_exported(eagle_models, plain, compile_cache_dir) -> None:
    """compile: on compiles the head's dense path beside the target's (workers/models/compiled.py: CompiledHead):
    chains and trees through both graphs give plain decoding's tokens, and the head's buckets are exported."""
    from prometheus_client import CollectorRegistry

    from workers.worker.engine_metrics import EngineMetrics

    engine = spec_engine(
        eagle_models, draft=None, eagle="copy_head", speculative_method="eagle", tree_size=6, tree_branching=2,
        compile="on", compile_cache_dir=str(compile_cache_dir),
    )  # fmt: skip
    outs = run_all(engine, requests(make_prompts()))
    assert {rid: tokens(o) for rid, o in outs.items()} == plain
    head = engine.compile_stats["eagle"]
    assert all(head.is_compiled.values()) and head.num_failures == 0 and head.compile_time_s > 0
    assert engine.speculator.stats.counts.num_accepted > 0
    registry = CollectorRegistry()
    EngineMetrics(registry).update(engine, [])
    for bucket in head.is_compiled:
        assert registry.get_sample_value("specfleet_engine_compiled", {"model": "eagle", "bucket": bucket}) == 1
    assert registry.get_sample_value("specfleet_engine_compile_failures_total", {"model": "eagle"}) == 0


@pytest.mark.parametrize("tree_size", [0, 5])
def test_seeded_sampling_with_eagle_is_reproducible(eagle_models, tree_size) -> None:
    params = SamplingParams(max_tokens=30, temperature=0.8, top_p=0.95, seed=77, ignore_eos=True)
    runs = []
    for _ in range(2):
        engine = spec_engine(eagle_models, draft=None, eagle="copy_head", speculative_method="eagle", tree_size=tree_size)
        runs.append(tokens(run_all(engine, {"s": (make_prompts()[4], params)})["s"]))
    assert runs[0] == runs[1] and len(runs[0]) == 30


def test_eagle_metrics_per_position_and_per_request(eagle_models) -> None:
    engine = spec_engine(
        eagle_models, draft=None, eagle="copy_head", speculative_method="eagle", is_adaptive=False,
        num_speculative_tokens=3,
    )  # fmt: skip
    outs = run_all(engine, requests(make_prompts()[40:46]))
    eagle = engine.speculator.stats.methods[SpeculativeMethod.EAGLE]
    assert len(eagle.counts.per_position_acceptance()) == 3 and eagle.counts.num_steps > 0
    assert all("mean_accepted_tokens" in o[-1].metrics for o in outs.values())


def test_eagle_without_a_head_is_refused_clearly(eagle_models) -> None:
    engine = spec_engine(eagle_models)  # a draft model, no head
    with pytest.raises(InvalidRequestError, match="no EAGLE head"):
        engine.add_request("x", [1, 2, 3], greedy(4, speculative="eagle"))
    with pytest.raises(ValueError, match="no EAGLE head"):
        spec_engine(eagle_models, speculative_method="eagle")


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("hidden_size", 32, "hidden_size: head 32"),
        ("vocab_size", 1000, "vocab_size: head 1000"),
        ("target_num_layers", 7, "num_layers: head 7"),
        ("feature_layer_ids", [5], "feature_layer_ids: head \\[5\\]"),
        ("draft_vocab_size", 4096, "draft_vocab_size: head 4096, target vocabulary 512"),
        ("draft_vocab_size", 100, "names a draft vocabulary of 100 tokens, but the weights hold no 'draft_vocab'"),
    ],
)
def test_a_head_for_another_target_is_refused(eagle_models, tmp_path, field, value, message) -> None:
    head_dir = tmp_path / "head"
    shutil.copytree(eagle_models["copy_head"], head_dir)
    config = json.loads((head_dir / "config.json").read_text())
    config[field] = value
    (head_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(HeadMismatchError, match=message):
        spec_engine(dict(eagle_models, bad=head_dir), draft=None, eagle="bad", speculative_method="eagle")


def test_a_failing_head_falls_back_without_losing_jobs(eagle_models, plain, tmp_path) -> None:
    from safetensors.torch import load_file, save_file

    head_dir = tmp_path / "nan-head"
    shutil.copytree(eagle_models["copy_head"], head_dir)
    weights = load_file(str(head_dir / "model.safetensors"))
    weights["fc.bias"] = weights["fc.bias"] * float("nan")
    save_file(weights, str(head_dir / "model.safetensors"))
    engine = spec_engine(dict(eagle_models, nan=head_dir), draft=None, eagle="nan", speculative_method="eagle")
    outs = run_all(engine, requests(make_prompts()[:8]))
    assert {rid: tokens(o) for rid, o in outs.items()} == {str(i): plain[str(i)] for i in range(8)}
    assert engine.speculator.stats.num_fallbacks == 8
    assert all(o[-1].metrics["spec_fallback"] == 1.0 for o in outs.values())


def test_a_draft_vocabulary_drafts_only_its_tokens(eagle_models) -> None:
    """vocab_head's logits: copy_head's on the even ids (the same LM head rows), -inf on every odd id."""
    import torch

    engine = spec_engine(eagle_models, draft=None, eagle="vocab_head", speculative_method="eagle")
    full = spec_engine(eagle_models, draft=None, eagle="copy_head", speculative_method="eagle")
    head, full_head = engine.speculator.eagle.runner.head, full.speculator.eagle.runner.head
    h = torch.randn(3, head.cfg.hidden_size, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    logits, reference = head.logits(h), full_head.logits(h)  # [3, V] each
    assert head.draft_vocab is not None and head.draft_vocab.tolist() == list(range(0, head.cfg.vocab_size, 2))
    assert torch.isneginf(logits[:, 1::2]).all()
    torch.testing.assert_close(logits[:, 0::2], reference[:, 0::2])


@pytest.mark.parametrize(
    ("ids", "message"),
    [
        ([0, 2, 2, 4], "distinct, ascending"),
        ([4, 2, 6, 8], "distinct, ascending"),
        ([0, 2, 4, 600], "in \\[0, 512\\)"),
    ],
)
def test_a_bad_draft_vocabulary_is_refused(eagle_models, tmp_path, ids, message) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    head_dir = tmp_path / "head"
    shutil.copytree(eagle_models["copy_head"], head_dir)
    weights = load_file(str(head_dir / "model.safetensors"))
    weights["draft_vocab"] = torch.tensor(ids)
    save_file(weights, str(head_dir / "model.safetensors"))
    config = json.loads((head_dir / "config.json").read_text())
    (head_dir / "config.json").write_text(json.dumps(config | {"draft_vocab_size": len(ids)}))
    with pytest.raises(HeadMismatchError, match=message):
        spec_engine(dict(eagle_models, bad=head_dir), draft=None, eagle="bad", speculative_method="eagle")
