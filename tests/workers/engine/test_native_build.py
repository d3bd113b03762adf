"""The native kernels' build (workers/engine/native_build.py): `host` keeps the library built for this CPU,
`portable` serves every model from the build without the bfloat16 dot instruction and decodes the unfused
engine's tokens, float32 models keep the host build (both sum their products alike), `auto` times both builds
and keeps the faster, the runners are left as fusing then chose, and the choice is exported. Where this CPU has
no AVX512-BF16 the host build already sums in columns: every mode keeps it."""

import json
from pathlib import Path

import pytest
import torch
from prometheus_client import CollectorRegistry

from tests.helpers.models import cpu_flags
from tests.workers.engine_runs import run_all, spec_engine, tokens
from tests.workers.spec.test_engine_eagle import requests
from tests.workers.spec.test_engine_speculation import make_prompts
from workers.engine.native_build import PORTABLE_FLAGS, NativeBuild, batch_sizes, choose_build, decision_path
from workers.models import native_attention
from workers.models.fused_decode import pair_rows
from workers.worker.engine_metrics import EngineMetrics

HAS_BF16_DOT = "avx512_bf16" in cpu_flags()
SUMS_ALIKE = "the host build sums this model's products as the portable one does"


def runners(engine) -> dict:
    return {"target": engine.runner, "draft": engine.speculator.draft.runner, "eagle": engine.speculator.eagle.runner}


def portable_library(engine) -> native_attention.NativeAttention:
    library = native_attention.load(engine.compile_cache_dir / "native", PORTABLE_FLAGS)
    assert library is not None
    return library


def bf16_engine(eagle_models, **overrides):
    return spec_engine(eagle_models, eagle="copy_head", dtype="bfloat16", **overrides)


@pytest.fixture(scope="module")
def unfused_tokens(eagle_models) -> dict[str, list[int]]:
    engine = bf16_engine(eagle_models, speculative_method="none", fused_layers="off", native_build="host")
    return {rid: tokens(o) for rid, o in run_all(engine, requests(make_prompts()[::3])).items()}


def test_batch_sizes_double_up_to_the_largest_batch() -> None:
    assert batch_sizes(1) == [1]
    assert batch_sizes(32) == [1, 2, 4, 8, 16, 32]
    assert batch_sizes(24) == [1, 2, 4, 8, 16, 24]


def test_host_keeps_the_library_built_for_this_cpu(eagle_models) -> None:
    engine = bf16_engine(eagle_models, speculative_method="none", native_build="host")
    choice = engine.native_build
    assert choice.build is NativeBuild.HOST and choice.reason == "host" and not choice.timed_ms
    assert all(runner.native is engine.runner.native for runner in runners(engine).values())
    assert bool(pair_rows(engine.runner.native, torch.bfloat16)) == HAS_BF16_DOT


@pytest.mark.parametrize("method", ["none", "eagle", "draft"])
def test_portable_serves_every_model_and_decodes_the_unfused_tokens(eagle_models, unfused_tokens, method) -> None:
    engine = bf16_engine(eagle_models, speculative_method=method, fused_layers="on", native_build="portable")
    if HAS_BF16_DOT:
        assert engine.native_build.build is NativeBuild.PORTABLE
        assert all(runner.native is portable_library(engine) for runner in runners(engine).values())
        assert pair_rows(engine.runner.native, torch.bfloat16) == 0  # bfloat16 weights in columns
    else:
        assert engine.native_build.build is NativeBuild.HOST and engine.native_build.reason == SUMS_ALIKE
    assert all(runner.fused is not None for runner in runners(engine).values())
    outs = run_all(engine, requests(make_prompts()[::3]))
    assert {rid: tokens(o) for rid, o in outs.items()} == unfused_tokens
    if method != "none":
        assert engine.speculator.stats.counts.num_accepted > 0  # the portable proposers drafted, and were kept


def test_float32_models_keep_the_host_build(eagle_models) -> None:
    engine = spec_engine(eagle_models, eagle="copy_head", dtype="float32", native_build="portable")
    assert engine.native_build.build is NativeBuild.HOST and engine.native_build.reason == SUMS_ALIKE
    assert not engine.native_build.timed_ms


def auto_decision_path(engine) -> Path:
    cache_dir = engine.compile_cache_dir / "native"
    host = native_attention.load(cache_dir)
    assert host is not None
    return decision_path(cache_dir, host, torch.bfloat16, engine.cfg.max_num_seqs, repr(engine.runner.model.cfg))


def test_auto_times_both_builds_and_keeps_the_faster(eagle_models) -> None:
    first = bf16_engine(eagle_models, speculative_method="none", native_build="host", max_num_seqs=8)
    auto_decision_path(first).unlink(missing_ok=True)  # an earlier run's decision for this model: timed again
    engine = bf16_engine(eagle_models, speculative_method="none", native_build="auto", max_num_seqs=8)
    choice = engine.native_build
    if not HAS_BF16_DOT:
        assert choice.build is NativeBuild.HOST and choice.reason == SUMS_ALIKE and not choice.timed_ms
        return
    timed = list(choice.timed_ms)
    assert timed and timed == batch_sizes(8)[: len(timed)]  # in order, from one token
    for ms in choice.timed_ms.values():
        assert set(ms) == {"host", "portable"} and all(v > 0 for v in ms.values())
    portable_ms = sum(ms["portable"] for ms in choice.timed_ms.values())
    host_ms = sum(ms["host"] for ms in choice.timed_ms.values())
    if choice.build is NativeBuild.PORTABLE:
        assert timed == batch_sizes(8) and portable_ms < host_ms and "and in all" in choice.reason
        assert engine.runner.native is portable_library(engine)
    else:
        assert choice.reason.startswith(("portable slower at one token", "at ")) or "not faster in all" in choice.reason
        assert engine.runner.native is not portable_library(engine)
    # the measuring left the runner as it found it: fusing then bound its own layers and chose its passes
    assert engine.runner.fused_max_tokens == engine.fusing["target"].max_tokens
    # kept beside the libraries: the next engine of this model on this host takes the same build, untimed
    again = bf16_engine(eagle_models, speculative_method="none", native_build="auto", max_num_seqs=8)
    assert again.native_build.build is choice.build and again.native_build.timed_ms == choice.timed_ms
    assert again.native_build.reason == f"as timed on this host before ({auto_decision_path(engine).name}): {choice.reason}"
    assert again.runner.native is engine.runner.native


def test_a_decision_file_that_does_not_read_is_timed_again(eagle_models) -> None:
    first = bf16_engine(eagle_models, speculative_method="none", native_build="host", max_num_seqs=4)
    path = auto_decision_path(first)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text('{"build": "fastest"}')
    engine = bf16_engine(eagle_models, speculative_method="none", native_build="auto", max_num_seqs=4)
    if HAS_BF16_DOT:
        assert engine.native_build.timed_ms and not engine.native_build.reason.startswith("as timed")
        assert json.loads(path.read_text())["build"] == engine.native_build.build.value  # written again


def test_a_kept_host_decision_never_builds_the_portable_library(eagle_models, tmp_path: Path) -> None:
    """`auto` reads its kept decision first: where it is `host`, the portable library is neither built (~20 s)
    nor loaded; the runner is left as it was found."""
    engine = bf16_engine(eagle_models, speculative_method="none", native_build="host", max_num_seqs=4)
    host, runner = engine.runner.native, engine.runner
    model_key = repr(runner.model.cfg)
    path = decision_path(tmp_path, host, torch.bfloat16, 4, model_key)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"build": "host", "reason": "timed", "timed_ms": {"1": {"host": 1.0, "portable": 2.0}}}))
    fused = runner.fused
    library, choice = choose_build(runner, host, NativeBuild.AUTO, torch.bfloat16, tmp_path, 4, model_key)
    assert library is host and choice.build is NativeBuild.HOST
    assert not list(tmp_path.glob("*.so"))
    assert runner.fused is fused and runner.native is host
    if HAS_BF16_DOT:
        assert choice.reason == f"as timed on this host before ({path.name}): timed"
        assert choice.timed_ms == {1: {"host": 1.0, "portable": 2.0}}
    else:
        assert choice.reason == SUMS_ALIKE


def test_the_build_is_exported_and_sdpa_engines_have_none(eagle_models) -> None:
    for engine in (
        bf16_engine(eagle_models, speculative_method="none", native_build="portable"),
        bf16_engine(eagle_models, speculative_method="none", attention_backend="sdpa"),
    ):
        registry = CollectorRegistry()
        EngineMetrics(registry).update(engine, [])
        for build in NativeBuild:
            value = registry.get_sample_value("specfleet_engine_native_build", {"build": build.value})
            is_chosen = engine.native_build is not None and engine.native_build.build is build
            assert value == (1.0 if is_chosen else None)
    assert engine.native_build is None  # the SDPA engine: no native kernels
