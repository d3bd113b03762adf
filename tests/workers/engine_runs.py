"""Driving an Engine in tests: make one on a test checkpoint, run requests, collect outputs, read their tokens."""

from collections.abc import Callable
from pathlib import Path
from typing import Any

from shared.speculation import SpeculativeMethod
from workers.engine.config import EngineConfig
from workers.engine.engine import Engine
from workers.engine.outputs import StepOutput
from workers.engine.sampling_params import SamplingParams
from workers.spec.pass_costs import PassCostTable

CostFn = Callable[[int], float]  # tokens in a pass -> seconds


def target_like_a_cpu(num_tokens: int) -> float:
    """A target pass that is mostly fixed cost: 10 ms, plus 0.3 ms per token (a small batch is nearly free)."""
    return 10e-3 + 0.3e-3 * num_tokens


def draft_like_a_cpu(num_tokens: int) -> float:
    """A draft pass one hundredth of the target's."""
    return 0.1e-3 + 0.003e-3 * num_tokens


def make_engine(
    target_dir: Path, draft_dir: Path | None = None, eagle_dir: Path | None = None, **overrides: Any
) -> Engine:
    """An engine on test checkpoints: float32, 4 MiB of KV in blocks of 4 tokens, plain decoding by default
    (the engine's own default speculates with what it holds), unless overridden."""
    settings = dict(dtype="float32", kv_cache_mb=4, block_size=4, speculative_method="none") | overrides
    return Engine(EngineConfig(**settings), target_dir, draft_dir, eagle_dir)


def spec_engine(
    models: dict[str, Path],
    draft: str | None = "close_draft",
    eagle: str | None = None,
    costs: tuple[CostFn, CostFn] | None = (target_like_a_cpu, draft_like_a_cpu),
    **overrides: Any,
) -> Engine:
    """make_engine on the spec_models fixture's checkpoints: float64, 16 MiB of KV, the draft model speculating
    (draft names one of the fixture's drafts; None: no draft model; eagle one of its EAGLE heads, None: no
    head), unless overridden. The fixture's drafts cost what their target does, so the engine's measured
    costs would rightly turn speculation off: `costs` pins the pass costs the length policy sees (target;
    draft and head) to a host where speculation pays, so tests get the same lengths on any machine; None
    keeps the measured ones."""
    settings = dict(dtype="float64", kv_cache_mb=16, speculative_method=SpeculativeMethod.DRAFT) | overrides
    engine = make_engine(models["target"], models[draft] if draft else None, models[eagle] if eagle else None, **settings)
    if costs is not None:
        pin_costs(engine, *costs)
    return engine


def pin_costs(engine: Engine, target_s: CostFn, proposer_s: CostFn) -> None:
    """Fixed pass-cost tables for the engine's length policy, no longer fed by the passes it runs; no step
    overhead (step_overhead.py): with the passes unobserved, a whole step would count as overhead; and no
    goodput guard (goodput_guard.py), whose veto would follow this host's timings."""
    speculator = engine.speculator
    speculator.step_overhead.observe = lambda *step: None  # type: ignore[method-assign]
    speculator.guard.observe = lambda *step: None  # type: ignore[method-assign]
    speculator.target_costs = fixed_table(target_s, speculator.target_costs.max_tokens)
    engine.runner.on_pass = None
    for name, table in list(speculator.proposer_costs.items()):
        speculator.proposer_costs[name] = fixed_table(proposer_s, table.max_tokens)
    for proposer in (speculator.draft, speculator.eagle):
        if proposer is not None:
            proposer.runner.on_pass = None


def fixed_table(cost_s: CostFn, max_tokens: int) -> PassCostTable:
    table = PassCostTable(max_tokens=max_tokens)
    for num_tokens in table.grid:
        table.observe(num_tokens, cost_s(num_tokens))
    return table


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
