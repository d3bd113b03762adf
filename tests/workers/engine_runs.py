"""Driving an Engine in tests: make one on a test checkpoint, run requests, collect outputs, read their tokens."""

from pathlib import Path
from typing import Any

from shared.speculation import SpeculativeMethod
from workers.engine.config import EngineConfig
from workers.engine.engine import Engine
from workers.engine.outputs import StepOutput
from workers.engine.sampling_params import SamplingParams


def make_engine(
    target_dir: Path, draft_dir: Path | None = None, eagle_dir: Path | None = None, **overrides: Any
) -> Engine:
    """An engine on test checkpoints: float32, 4 MiB of KV in blocks of 4 tokens, plain decoding by default
    (the configured default method, draft, needs a draft model), unless overridden."""
    settings = dict(dtype="float32", kv_cache_mb=4, block_size=4, speculative_method="none") | overrides
    return Engine(EngineConfig(**settings), target_dir, draft_dir, eagle_dir)


def spec_engine(
    models: dict[str, Path], draft: str | None = "close_draft", eagle: str | None = None, **overrides: Any
) -> Engine:
    """make_engine on the spec_models fixture's checkpoints: float64, 16 MiB of KV, the draft model speculating
    (draft names one of the fixture's drafts; None: no draft model; eagle one of its EAGLE heads, None: no
    head), unless overridden."""
    settings = dict(dtype="float64", kv_cache_mb=16, speculative_method=SpeculativeMethod.DRAFT) | overrides
    return make_engine(models["target"], models[draft] if draft else None, models[eagle] if eagle else None, **settings)


def run_all(engine: Engine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, list[StepOutput]]:
    """Add every request, step until all finish; each request's outputs in order."""
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    outputs: dict[str, list[StepOutput]] = {rid: [] for rid in requests}
    while engine.num_unfinished():
        for out in engine.step():
            outputs[out.request_id].append(out)
    return outputs


def tokens(outs: list[StepOutput]) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def greedy(max_tokens: int = 32, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)
