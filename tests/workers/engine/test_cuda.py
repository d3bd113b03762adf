"""The engine on a CUDA device: skipped where none is visible (CI has none); run on a lent GPU machine with
`python -m pytest tests/workers/engine/test_cuda.py` (README, "On a GPU").

Float64 throughout, so the CPU and the GPU round alike enough for greedy tokens to be compared exactly: the
CPU engine is held to transformers by the exactness tests, the CUDA engine is held to the CPU engine here."""

from pathlib import Path

import pytest
import torch

from shared.speculation import SpeculativeMethod
from tests.workers.engine_runs import greedy, make_engine, run_all, spec_engine, tokens
from workers.engine import engine as engine_module
from workers.engine.outputs import StepOutput
from workers.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _requests(num: int, max_tokens: int = 24) -> dict[str, tuple[list[int], SamplingParams]]:
    gen = torch.Generator().manual_seed(11)
    return {
        f"r{i}": (torch.randint(1, 400, (3 + 11 * i,), generator=gen).tolist(), greedy(max_tokens + 3 * i))
        for i in range(num)
    }


@pytest.mark.parametrize("layout", ["llama", "qwen2", "mistral"])
def test_cuda_engine_decodes_the_cpu_engines_tokens_with_and_without_graphs(
    tiny_models: dict[str, Path], layout: str
) -> None:
    requests = _requests(9)
    on_cpu = run_all(make_engine(tiny_models[layout], dtype="float64", device="cpu"), requests)
    graphed = make_engine(tiny_models[layout], dtype="float64", device="cuda")
    op_by_op = make_engine(tiny_models[layout], dtype="float64", device="cuda", cuda_graphs=False)

    assert graphed.runner.kv_caches[0][0].device.type == "cuda"
    assert set(graphed.graph_capture_s) == {"target"} and op_by_op.runner.graphs is None
    graphs = graphed.runner.graphs
    assert graphs is not None and len(graphs.graphs) == len(graphs.buckets)
    for engine in (graphed, op_by_op):
        outputs = run_all(engine, requests)
        for rid in requests:
            assert tokens(outputs[rid]) == tokens(on_cpu[rid]), (layout, rid, engine.cfg.cuda_graphs)
    assert graphs.num_passes > 0


@pytest.mark.parametrize("method", [SpeculativeMethod.DRAFT, SpeculativeMethod.EAGLE, SpeculativeMethod.NGRAM])
def test_speculation_on_cuda_keeps_the_target_output(eagle_models: dict[str, Path], method: SpeculativeMethod) -> None:
    requests = _requests(4, max_tokens=30)
    plain = run_all(make_engine(eagle_models["target"], dtype="float64", device="cpu"), requests)
    eagle = "copy_head" if method is SpeculativeMethod.EAGLE else None
    engine = spec_engine(eagle_models, eagle=eagle, speculative_method=method, device="cuda")
    speculative = run_all(engine, requests)

    assert set(engine.graph_capture_s) == {"target", "draft"} | ({"eagle"} if eagle else set())
    if method is not SpeculativeMethod.NGRAM:  # n-grams need repeats the random prompts may not bring
        assert engine.speculator.stats.counts.num_accepted > 0
        graphs = engine.runner.graphs  # the target's chain verify passes (1 + k tokens a row) replay graphs too
        assert graphs is not None and sum(n for q, n in graphs.num_passes_by_queries.items() if q > 1) > 0
    for rid in requests:
        assert tokens(speculative[rid]) == tokens(plain[rid]), (method, rid)


@pytest.mark.parametrize("method", [SpeculativeMethod.DRAFT, SpeculativeMethod.EAGLE])
def test_tree_speculation_on_cuda_replays_its_verify_passes_and_keeps_the_target_output(
    eagle_models: dict[str, Path], method: SpeculativeMethod
) -> None:
    requests = _requests(4, max_tokens=30)
    plain = run_all(make_engine(eagle_models["target"], dtype="float64", device="cpu"), requests)
    eagle = "copy_head" if method is SpeculativeMethod.EAGLE else None
    engine = spec_engine(eagle_models, eagle=eagle, speculative_method=method, device="cuda", tree_size=5)
    speculative = run_all(engine, requests)

    assert engine.speculator.stats.counts.num_accepted > 0
    graphs = engine.runner.graphs  # every verify pass a tree of up to 5 nodes after the last token
    assert graphs is not None and sum(n for q, n in graphs.num_passes_by_queries.items() if q > 1) > 0
    for rid in requests:
        assert tokens(speculative[rid]) == tokens(plain[rid]), (method, rid)


def test_logits_leave_the_device_only_for_the_steps_that_read_more_than_their_argmax(
    tiny_target: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    copies: list[tuple[int, int]] = []  # the [S, V] shapes the engine copied to the host

    def counted_to_host(t: torch.Tensor) -> torch.Tensor:
        copies.append(tuple(t.shape))
        return t.cpu()

    monkeypatch.setattr(engine_module, "to_host", counted_to_host)
    greedy_only = _requests(4)
    mixed = {
        **_requests(3),  # greedy, up to 30 tokens: the last steps are greedy alone again
        "seeded": ([5, 17, 29, 3], SamplingParams(max_tokens=12, temperature=0.8, seed=7, ignore_eos=True)),
        "logprobs": ([8, 2, 44], greedy(10, logprobs=3)),
        "prompt_logprobs": ([9, 13, 7, 21, 2], greedy(6, prompt_logprobs=2)),
    }
    want = {name: run_all(make_engine(tiny_target, dtype="float64", device="cpu"), reqs)
            for name, reqs in (("greedy", greedy_only), ("mixed", mixed))}
    engine = make_engine(tiny_target, dtype="float64", device="cuda")
    copies.clear()

    got = run_all(engine, greedy_only)
    assert copies == []  # each step's argmax came back alone
    for rid in greedy_only:
        assert tokens(got[rid]) == tokens(want["greedy"][rid]), rid

    got = run_all(engine, mixed)
    assert 0 < len(copies) < max(len(out) for out in got.values())  # not once the sampling ones had finished
    for rid in mixed:
        assert tokens(got[rid]) == tokens(want["mixed"][rid]), rid
    for rid in ("logprobs", "prompt_logprobs"):
        assert _logprobs(got[rid]) == pytest.approx(_logprobs(want["mixed"][rid]), abs=1e-9), rid


def _logprobs(outs: list[StepOutput]) -> list[float]:
    prompt = [lp.logprob for o in outs for lp in o.prompt_logprobs or [] if lp.logprob is not None]
    return prompt + [lp.logprob for o in outs for lp in o.new_logprobs or [] if lp.logprob is not None]


def test_bfloat16_on_cuda_generates(tiny_target: Path) -> None:
    engine = make_engine(tiny_target, dtype="auto", device="cuda")
    assert engine.runner.model.embed.weight.dtype == torch.bfloat16
    outputs = run_all(engine, _requests(4))
    assert all(len(tokens(out)) == 24 + 3 * i for i, out in enumerate(outputs.values()))
