"""Priority preemption keeps every output exact: batch requests preempted for interactive ones give the tokens
they give uninterrupted, greedy and seeded sampling, speculating with the draft model (the demanding case: a
plain seeded request draws once per token, so its draws stay in step however it is recomputed; seeded
requests draft by their own acceptance, not timing), in float64 (so the comparison tests the algorithm, not
rounding). Short of slots only, the batch requests are parked with their KV; short of KV, their KV is freed
and they are recomputed. Without the scheduler's "recompute up to the last token, then decode it" the
recomputed seeded request fails here."""

from pathlib import Path

import torch

from tests.workers.engine_runs import greedy, run_all, spec_engine, tokens
from workers.engine.engine import Engine
from workers.engine.outputs import StepOutput
from workers.engine.sampling_params import SamplingParams

INTERACTIVE, BATCH = 0, 2
NUM_TIGHT_BLOCKS = 16  # of 4 tokens: the two batch requests and an interactive one do not fit at once


def seeded(max_tokens: int, seed: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.9, top_k=50, seed=seed, ignore_eos=True)


def batch_requests() -> dict[str, tuple[list[int], SamplingParams]]:
    gen = torch.Generator().manual_seed(11)
    prompt = [torch.randint(1, 512, (n,), generator=gen).tolist() for n in (9, 14)]
    return {"greedy": (prompt[0], greedy(28)), "seeded": (prompt[1], seeded(28, seed=4321))}


def interrupted(
    engine: Engine, batch: dict[str, tuple[list[int], SamplingParams]], interactive_prompt_len: int
) -> tuple[dict[str, list[StepOutput]], list[str]]:
    """Start the batch requests, let them decode a few steps, then add two interactive ones -> every request's
    outputs, and the order requests finished in."""
    outputs: dict[str, list[StepOutput]] = {rid: [] for rid in [*batch, "i0", "i1"]}
    finished: list[str] = []

    def step() -> None:
        for out in engine.step():
            outputs[out.request_id].append(out)
            if out.finished:
                finished.append(out.request_id)

    for rid, (prompt, params) in batch.items():
        engine.add_request(rid, prompt, params, priority=BATCH)
    for _ in range(5):
        step()
    for i in range(2):
        engine.add_request(f"i{i}", [5 + i] * interactive_prompt_len, greedy(6), priority=INTERACTIVE)
    while engine.num_unfinished():
        step()
    return outputs, finished


def test_preempted_greedy_and_seeded_jobs_give_the_tokens_of_unpreempted_runs(spec_models: dict[str, Path]) -> None:
    engine = spec_engine(spec_models, max_num_seqs=2, speculative_method="draft")
    batch = batch_requests()
    alone = {rid: tokens(run_all(engine, {rid: request})[rid]) for rid, request in batch.items()}
    assert all(len(t) == 28 for t in alone.values())

    # short of slots: the two interactive requests take both; the batch ones are parked with their KV
    outputs, finished = interrupted(engine, batch, interactive_prompt_len=3)
    assert set(finished[:2]) == {"i0", "i1"}  # the interactive requests did not wait for the batch ones
    for rid in batch:
        assert outputs[rid][-1].metrics["num_preemptions"] >= 1
        assert tokens(outputs[rid]) == alone[rid]

    # short of KV: the batch requests' KV is freed and they are recomputed
    bytes_per_block = engine.cfg.kv_cache_mb * 2**20 / engine.block_manager.num_blocks
    tight = spec_engine(spec_models, max_num_seqs=8, speculative_method="draft",
                        kv_cache_mb=(NUM_TIGHT_BLOCKS + 0.5) * bytes_per_block / 2**20)  # fmt: skip
    assert tight.block_manager.num_blocks == NUM_TIGHT_BLOCKS
    outputs, finished = interrupted(tight, batch, interactive_prompt_len=20)
    assert set(finished[:2]) == {"i0", "i1"}
    for rid in batch:
        assert outputs[rid][-1].metrics["num_preemptions"] >= 1
        assert tokens(outputs[rid]) == alone[rid]
    assert tight.block_manager.num_free_blocks == NUM_TIGHT_BLOCKS
