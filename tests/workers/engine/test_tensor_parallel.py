"""The target over two tensor-parallel ranks (gloo, two real processes on this CPU) against one rank.

One TP = 2 engine (and its TP = 1 twin) serves the mixed tests: the one-layer tiny target with a close draft
and an EAGLE head, speculation by draft, EAGLE, n-gram and none (token trees and chains), a KV budget small
enough to preempt and a token budget that chunks prompts; greedy output must be token-identical and float32
logits within 1e-4. Each other layout gets its own pair; a real SIGKILL of rank 1 must fail the engine, not
hang it."""

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from tests.workers.engine_runs import greedy, make_engine, spec_engine, tokens
from tests.workers.spec.test_engine_speculation import make_prompts
from workers.engine.config import EngineConfig
from workers.engine.engine import Engine
from workers.engine.model_runner import ForwardItem
from workers.engine.outputs import StepOutput
from workers.engine.sampling_params import SamplingParams
from workers.engine.tp_group import RankFailedError
from workers.models.sharding import TensorParallelError

CHOICES = [None, "none", "ngram", "draft", "eagle"]  # None: the engine's method (draft)
MIXED = dict(eagle="copy_head", tree_size=5, dtype="float32", kv_cache_mb=0.15, max_num_batched_tokens=16)


def run_staggered(
    engine: Engine, requests: dict[str, tuple[list[int], SamplingParams]], abort: str | None = None
) -> dict[str, list[StepOutput]]:
    """Half the requests first, the rest three steps later (prefills beside decodes); `abort` is dropped
    after five steps. Each finished request's outputs."""
    items = list(requests.items())
    outputs: dict[str, list[StepOutput]] = {rid: [] for rid in requests}
    num_steps = 0
    pending = items[len(items) // 2 :]
    for rid, (prompt, params) in items[: len(items) // 2]:
        engine.add_request(rid, prompt, params)
    while engine.num_unfinished() or pending:
        if num_steps == 3:
            for rid, (prompt, params) in pending:
                engine.add_request(rid, prompt, params)
            pending = []
        if num_steps == 5 and abort is not None:
            assert engine.abort(abort)
        for out in engine.step():
            outputs[out.request_id].append(out)
        num_steps += 1
    return {rid: outs for rid, outs in outputs.items() if rid != abort}


def token_ids(outputs: dict[str, list[StepOutput]]) -> dict[str, list[int]]:
    return {rid: tokens(outs) for rid, outs in outputs.items()}


def mixed_requests() -> dict[str, tuple[list[int], SamplingParams]]:
    prompts = make_prompts()[::2]
    return {str(i): (p, greedy(20 + i % 7, speculative=CHOICES[i % len(CHOICES)])) for i, p in enumerate(prompts)}


@pytest.fixture(scope="module")
def engines(eagle_models: dict[str, Path]) -> Iterator[tuple[Engine, Engine]]:
    """(TP = 1, TP = 2) on the same settings (MIXED)."""
    tp2 = spec_engine(eagle_models, tensor_parallel_size=2, **MIXED)
    try:
        yield spec_engine(eagle_models, **MIXED), tp2
    finally:
        tp2.close()


def logits_of(engine: Engine, prompts: list[list[int]]) -> torch.Tensor:  # [sum of prompt lengths, V]
    """Every position's logits, the prompts as one ragged prefill in fresh blocks (the engine is idle)."""
    items, next_block = [], 0
    for p in prompts:
        num_blocks = -(-len(p) // engine.cfg.block_size)
        items.append(ForwardItem(p, 0, list(range(next_block, next_block + num_blocks)), num_logits=len(p)))
        next_block += num_blocks
    return engine.runner.forward(items)


def test_greedy_output_is_identical_with_every_speculation_method_mixed(engines) -> None:
    tp1, tp2 = engines
    requests = mixed_requests()
    expected = token_ids(run_staggered(tp1, requests, abort="3"))
    outputs = run_staggered(tp2, requests, abort="3")
    assert token_ids(outputs) == expected
    stats = tp2.speculator.stats
    assert stats.counts.num_accepted > 0  # it really speculated, and the target accepted
    assert {m.value for m, s in stats.methods.items() if s.counts.num_steps} >= {"draft", "eagle", "ngram"}
    assert sum(outs[-1].metrics["num_preemptions"] for outs in outputs.values()) > 0  # the KV budget preempted


def test_fp32_logits_agree_within_1e_4(engines) -> None:
    tp1, tp2 = engines
    prompts = make_prompts()[:5]
    full, sharded = logits_of(tp1, prompts), logits_of(tp2, prompts)
    assert full.shape == sharded.shape == (sum(map(len, prompts)), 512)
    assert (full - sharded).abs().max().item() < 1e-4


def test_each_rank_holds_half_the_heads(engines) -> None:
    tp1, tp2 = engines
    full_cfg, local_cfg = tp1.runner.model.cfg, tp2.runner.model.cfg
    assert local_cfg.num_heads * 2 == full_cfg.num_heads and local_cfg.num_kv_heads * 2 == full_cfg.num_kv_heads
    assert tp2.runner.kv_caches[0][0].shape[2] == full_cfg.num_kv_heads // 2  # KV cache: this rank's heads only
    weight_bytes = tp2.runner.group.rank_weight_bytes  # rank 0 keeps the LM head, rank 1 does not
    assert 0 < weight_bytes[1] < weight_bytes[0]


@pytest.mark.parametrize("layout", ["qwen2", "mistral"])
def test_other_layouts_are_exact(tiny_models: dict[str, Path], layout: str) -> None:
    target = tiny_models[layout]
    tp1 = make_engine(target, speculative_method="ngram")
    tp2 = make_engine(target, speculative_method="ngram", tensor_parallel_size=2)
    try:
        prompts = make_prompts()[-6:]
        requests = {str(i): (p, greedy(16, speculative=("ngram", "none")[i % 2])) for i, p in enumerate(prompts)}
        assert token_ids(run_staggered(tp2, requests)) == token_ids(run_staggered(tp1, requests))
        assert (logits_of(tp1, prompts) - logits_of(tp2, prompts)).abs().max().item() < 1e-4
    finally:
        tp2.close()


def test_a_size_that_does_not_divide_the_heads_is_refused(tiny_target: Path) -> None:
    with pytest.raises(TensorParallelError, match="tensor_parallel_size 3 does not divide .* 4 attention heads"):
        make_engine(tiny_target, tensor_parallel_size=3)


def test_compile_with_tensor_parallel_is_refused() -> None:
    with pytest.raises(ValidationError, match="tensor_parallel_size > 1 set compile: off"):
        EngineConfig(tensor_parallel_size=2, compile="on")


def test_a_killed_rank_fails_the_engine_instead_of_hanging(tiny_target: Path) -> None:
    engine = make_engine(tiny_target, tensor_parallel_size=2)
    group = engine.runner.group
    try:
        engine.add_request("a", [5, 6, 7, 8], greedy(8))
        engine.step()
        os.kill(group.pids[0], signal.SIGKILL)
        group.procs[0].wait()
        with pytest.raises(RankFailedError, match="rank 1"):
            group.all_reduce(torch.ones(4))  # straight into a collective with the dead peer: it fails, not hangs
        with pytest.raises(RankFailedError):
            engine.step()  # and the engine stays failed
    finally:
        engine.close()
