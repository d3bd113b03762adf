"""vLLM's min_p in the engine, plain and speculative, on the one-layer tiny target in float64 (eagle_models):
min_p 1 keeps the likeliest token alone, so a sampled answer is the greedy one under every proposer (the
draft's q and the target's p went through the same transform); a seeded answer with a looser min_p is the same
whatever the batch; a bad value is refused."""

from pathlib import Path

import pytest

from tests.workers.engine_runs import run_all, tokens
from tests.workers.spec.test_engine_grammar import METHODS, engine_for
from tests.workers.spec.test_engine_speculation import make_prompts
from workers.engine.errors import InvalidRequestError
from workers.engine.sampling_params import SamplingParams

PROMPTS = [1, 7, 30, 41]  # indexes into make_prompts(): random ones and repetitive ones


def requests(**params) -> dict[str, tuple[list[int], SamplingParams]]:
    prompts = make_prompts()
    return {str(i): (prompts[i], SamplingParams(max_tokens=24, ignore_eos=True, **params)) for i in PROMPTS}


@pytest.fixture(scope="module")
def greedy(eagle_models: dict[str, Path]) -> dict[str, list[int]]:
    engine = engine_for(eagle_models, "none")
    return {rid: tokens(o) for rid, o in run_all(engine, requests(temperature=0.0)).items()}


@pytest.mark.parametrize("method", list(METHODS))
def test_min_p_one_samples_the_greedy_answer(eagle_models, greedy, method) -> None:
    engine = engine_for(eagle_models, method)
    outs = run_all(engine, requests(temperature=1.3, min_p=1.0, seed=3))
    assert {rid: tokens(o) for rid, o in outs.items()} == greedy
    if method != "none":
        assert engine.speculator.stats.counts.num_steps > 0  # it drafted


def test_a_seeded_min_p_answer_is_the_same_alone_and_in_a_batch(eagle_models, greedy) -> None:
    engine = engine_for(eagle_models, "draft-chain")
    batch = run_all(engine, requests(temperature=1.0, min_p=0.05, seed=9))
    alone = run_all(engine, {"7": requests(temperature=1.0, min_p=0.05, seed=9)["7"]})
    assert tokens(batch["7"]) == tokens(alone["7"])
    assert any(tokens(batch[rid]) != greedy[rid] for rid in batch)  # it sampled: not the greedy answers


@pytest.mark.parametrize("bad", [-0.1, 1.5, True, "0.5"])
def test_a_bad_min_p_is_refused(eagle_models, bad) -> None:
    engine = engine_for(eagle_models, "none")
    with pytest.raises(InvalidRequestError) as err:
        engine.add_request("bad", make_prompts()[0], SamplingParams(min_p=bad))
    assert err.value.field == "min_p"
    assert engine.num_unfinished() == 0
