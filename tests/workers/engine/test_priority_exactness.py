"""Priority preemption keeps every output exact: batch requests preempted for interactive ones (their KV freed,
recomputed later) give the tokens they give uninterrupted; greedy and seeded sampling, plain and speculating
with the draft model, in float64 (so the comparison tests the algorithm, not rounding). Without the
scheduler's "recompute up to the last token, then decode it" the speculating seeded request fails here."""

from pathlib import Path

import torch

from tests.workers.engine_runs import greedy, run_all, spec_engine, tokens
from workers.engine.engine import Engine
from workers.engine.outputs import StepOutput
from workers.engine.sampling_params import SamplingParams

INTERACTIVE, BATCH = 0, 2


def seeded(max_tokens: int, seed: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.9, top_k=50, seed=seed, ignore_eos=True)


def batch_requests() -> dict[str, tuple[list[int], SamplingParams]]:
    gen = torch.Generator().manual_seed(11)
    prompt = [torch.randint(1, 512, (n,), generator=gen).tolist() for n in (9, 14)]
    return {"greedy": (prompt[0], greedy(28)), "seeded": (prompt[1], seeded(28, seed=4321))}


def interrupted(
    engine: Engine, batch: dict[str, tuple[list[int], SamplingParams]]
) -> tuple[dict[str, list[StepOutput]], list[str]]:
    """Start the batch requests, let them decode a few steps, then add two interactive ones that take both
    slots (max_num_seqs 2) -> every request's outputs, and the order requests finished in."""
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
    engine.add_request("i0", [5, 6, 7], greedy(6), priority=INTERACTIVE)
    engine.add_request("i1", [8, 9], greedy(6), priority=INTERACTIVE)
    while engine.num_unfinished():
        step()
    return outputs, finished


def test_preempted_greedy_and_seeded_jobs_give_the_tokens_of_unpreempted_runs(spec_models: dict[str, Path]) -> None:
    # speculating with the draft model: the demanding case (a plain seeded request draws once per token, so its
    # draws stay in step however it is recomputed); seeded requests draft by their own acceptance, not timing
    engine = spec_engine(spec_models, max_num_seqs=2, speculative_method="draft")
    batch = batch_requests()
    alone = {rid: tokens(run_all(engine, {rid: request})[rid]) for rid, request in batch.items()}
    outputs, finished = interrupted(engine, batch)
    for rid in batch:
        assert outputs[rid][-1].metrics["num_preemptions"] >= 1
        assert tokens(outputs[rid]) == alone[rid]
        assert len(alone[rid]) == 28
    assert set(finished[:2]) == {"i0", "i1"}  # the interactive requests did not wait for the batch ones
