"""Start-up compilation (workers/engine/compilation.py): a failure falls back to eager, counted and exported;
a compiled forward that would recompile runs eager; `auto` measures both variants; for a model's runner and an
EAGLE head's alike. Exactness of the compiled path against transformers and the eager path:
tests/workers/models/test_exactness.py (models), tests/workers/spec/test_engine_eagle.py (the head)."""

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from prometheus_client import CollectorRegistry

from workers.engine.compilation import compile_runner
from workers.engine.compile_stats import Bucket, CompileMode
from workers.engine.config import EngineConfig
from workers.engine.engine import Engine
from workers.engine.interleaved import Verdict
from workers.engine.model_runner import ForwardItem, ModelRunner
from workers.engine.sampling_params import SamplingParams
from workers.models.loader import load_model
from workers.worker.engine_metrics import EngineMetrics


def greedy(engine: Engine, prompt: list[int], max_tokens: int = 16) -> list[int]:
    engine.add_request("r", prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    tokens: list[int] = []
    while engine.num_unfinished():
        for out in engine.step():
            tokens.extend(out.new_token_ids)
    return tokens


@pytest.fixture
def one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_failed_compilation_falls_back_to_eager_counted_and_exported(
    tiny_models: dict[str, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A real failure: inductor's C++ compiler does not exist (and the cache is empty, so it is needed)."""
    cfg = EngineConfig(dtype="float32", kv_cache_mb=4, block_size=4, speculative_method="none", compile="on",
                       compile_cache_dir=str(tmp_path / "cache"))
    with torch._inductor.config.patch({"cpp.cxx": (str(tmp_path / "no-such-compiler"),)}):
        engine = Engine(cfg, tiny_models["llama"])
    stats = engine.compile_stats["target"]
    assert stats.num_failures == 1 and not any(stats.is_compiled.values())
    assert "compiling the target model failed: it runs eager" in caplog.text
    eager = Engine(EngineConfig(dtype="float32", kv_cache_mb=4, block_size=4, speculative_method="none"),
                   tiny_models["llama"])
    assert greedy(engine, [5, 6, 7]) == greedy(eager, [5, 6, 7])  # the worker lives on, eager
    registry = CollectorRegistry()
    metrics = EngineMetrics(registry)
    metrics.update(engine, [])
    assert registry.get_sample_value("specfleet_engine_compile_failures_total", {"model": "target"}) == 1
    assert registry.get_sample_value("specfleet_engine_compiled", {"model": "target", "bucket": "decode"}) == 0


def test_auto_measures_each_bucket_and_a_recompile_runs_eager(
    tiny_models: dict[str, Path], compile_cache_dir: Path, one_thread: None
) -> None:
    """One compilation of a runner without a thread policy (every pass at the process's thread count)."""
    from workers.engine.compilation import point_cache_at

    point_cache_at(compile_cache_dir)
    runner = ModelRunner(load_model(tiny_models["llama"], torch.float32), num_blocks=32, block_size=4)
    stats = compile_runner(runner, CompileMode.AUTO, "target")
    assert stats.num_failures == 0 and stats.compile_time_s > 0
    assert set(stats.eager_ms) == set(stats.compiled_ms) == {Bucket.DECODE.value, Bucket.BATCH.value}
    assert set(stats.verdicts) == set(stats.eager_ms)
    for bucket, verdict in stats.verdicts.items():  # auto uses the compiled graph exactly where it was faster
        assert stats.is_compiled[bucket] == (verdict == Verdict.FASTER)

    stats.is_compiled = {b.value: True for b in Bucket}  # serve every bucket compiled, whatever auto measured
    items = [ForwardItem([3, 4, 5], 0, [7], num_logits=3)]
    torch.testing.assert_close(runner.forward(items), runner.forward_with(items, None), atol=1e-5, rtol=0)
    assert stats.num_failures == 0
    torch.set_num_threads(2)  # not what the graphs were compiled for: dynamo would recompile
    logits = runner.forward(items)
    assert stats.num_failures == 1 and not any(stats.is_compiled.values())
    torch.testing.assert_close(logits, runner.forward_with(items, None), atol=0, rtol=0)  # the eager rerun


def test_a_heads_dense_path_compiles_measures_and_falls_back_like_a_models(
    eagle_models: dict[str, Path], compile_cache_dir: Path, one_thread: None
) -> None:
    """The EAGLE head's runner through the same start-up compilation: auto times each bucket, a compiled pass
    matches the eager one (logits and h), and a pass that would recompile reruns eager, counted."""
    from workers.engine.compilation import point_cache_at
    from workers.engine.head_runner import HeadRunner
    from workers.models.eagle_head import load_head

    point_cache_at(compile_cache_dir)
    target = load_model(eagle_models["target"], torch.float32)
    runner = HeadRunner(load_head(eagle_models["copy_head"], target), num_blocks=32, block_size=4)
    stats = compile_runner(runner, CompileMode.AUTO, "eagle")
    assert stats.num_failures == 0 and stats.compile_time_s > 0 and runner.compiled is not None
    assert set(stats.eager_ms) == set(stats.compiled_ms) == {Bucket.DECODE.value, Bucket.BATCH.value}
    for bucket, verdict in stats.verdicts.items():
        assert stats.is_compiled[bucket] == (verdict == Verdict.FASTER)

    stats.is_compiled = {b.value: True for b in Bucket}
    items = [ForwardItem([3, 4, 5], 0, [7], num_logits=3)]
    features = torch.randn(3, target.cfg.hidden_size, generator=torch.Generator().manual_seed(0))  # [T, hidden]
    logits, h = runner.forward(items, features)
    stats.is_compiled = {b.value: False for b in Bucket}
    eager_logits, eager_h = runner.forward(items, features)
    torch.testing.assert_close(logits, eager_logits, atol=1e-5, rtol=0)
    torch.testing.assert_close(h, eager_h, atol=1e-5, rtol=0)
    stats.is_compiled = {b.value: True for b in Bucket}
    torch.set_num_threads(2)  # not what the graphs were compiled for: dynamo would recompile
    logits, _ = runner.forward(items, features)
    assert stats.num_failures == 1 and not any(stats.is_compiled.values())
    torch.testing.assert_close(logits, runner.forward(items, features)[0], atol=0, rtol=0)  # the eager rerun
