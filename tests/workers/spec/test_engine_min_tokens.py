"""vLLM's min_tokens and stop_token_ids under speculative decoding (workers/engine/min_tokens.py), on the one-layer
tiny target in float64 (eagle_models): a stop token pushed by logit_bias comes exactly at the min_tokens-th
position (never before), greedy output is token-identical with speculation on and off, `ignore_eos` leaves EOS
alone, a resumed job counts the output it had, and bad values are refused."""

from pathlib import Path

import pytest

from tests.workers.engine_runs import run_all, tokens
from tests.workers.spec.test_engine_grammar import METHODS, engine_for
from tests.workers.spec.test_engine_speculation import make_prompts
from workers.engine.errors import InvalidRequestError
from workers.engine.sampling_params import SamplingParams

STOP = 42  # a stop_token_ids token


def requests(eos: int) -> dict[str, tuple[list[int], SamplingParams]]:
    prompts = make_prompts()
    return {
        "eos": (prompts[1], SamplingParams(max_tokens=32, temperature=0.0, min_tokens=9, logit_bias={eos: 100.0})),
        "stop-id": (prompts[2], SamplingParams(max_tokens=32, temperature=0.0, min_tokens=5, stop_token_ids=[STOP],
                                                logit_bias={STOP: 100.0})),
        "sampled": (prompts[3], SamplingParams(max_tokens=32, temperature=1.0, seed=4, min_tokens=12,
                                                logit_bias={eos: 100.0})),
        "ignore-eos": (prompts[4], SamplingParams(max_tokens=6, temperature=0.0, min_tokens=4, ignore_eos=True,
                                                   logit_bias={eos: 100.0})),
        "free": (prompts[5], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)),
    }  # fmt: skip


@pytest.fixture(scope="module")
def plain(eagle_models: dict[str, Path]) -> dict[str, list[int]]:
    engine = engine_for(eagle_models, "none")
    return {rid: tokens(o) for rid, o in run_all(engine, requests(min(engine.eos_token_ids))).items()}


def test_the_stop_token_comes_at_min_tokens_and_not_before(eagle_models, plain) -> None:
    eos = min(engine_for(eagle_models, "none").eos_token_ids)
    assert len(plain["eos"]) == 10 and plain["eos"][-1] == eos and eos not in plain["eos"][:-1]
    assert len(plain["stop-id"]) == 6 and plain["stop-id"][-1] == STOP and STOP not in plain["stop-id"][:-1]
    assert len(plain["sampled"]) == 13 and plain["sampled"][-1] == eos
    assert plain["ignore-eos"] == [eos] * 6  # EOS stops nothing here: min_tokens does not hold it back


@pytest.mark.parametrize("method", [m for m in METHODS if m not in ("none", "eagle-draft-vocab")])
def test_greedy_output_is_the_same_with_speculation(eagle_models, plain, method) -> None:
    engine = engine_for(eagle_models, method)
    outs = {rid: tokens(o) for rid, o in run_all(engine, requests(min(engine.eos_token_ids))).items()}
    assert {rid: t for rid, t in outs.items() if rid != "sampled"} == {rid: t for rid, t in plain.items() if rid != "sampled"}
    assert len(outs["sampled"]) == 13  # sampled: the same rule, its own draws


def test_a_resumed_job_counts_the_output_it_had(eagle_models, plain) -> None:
    engine = engine_for(eagle_models, "draft-chain")
    eos = min(engine.eos_token_ids)
    done = plain["eos"]
    params = SamplingParams(max_tokens=32 - 4, temperature=0.0, min_tokens=9, logit_bias={eos: 100.0},
                            num_resumed_tokens=4)  # fmt: skip
    out = run_all(engine, {"r": (make_prompts()[1] + done[:4], params)})["r"]
    assert done[:4] + tokens(out) == done


def test_bad_values_are_refused(eagle_models) -> None:
    engine = engine_for(eagle_models, "none")
    vocab = engine.runner.model.cfg.vocab_size
    for bad, field in ((dict(min_tokens=17, max_tokens=16), "min_tokens"), (dict(min_tokens=-1), "min_tokens"),
                       (dict(stop_token_ids=[vocab]), "stop_token_ids"), (dict(stop_token_ids=[-1]), "stop_token_ids")):  # fmt: skip
        with pytest.raises(InvalidRequestError) as err:
            engine.add_request("bad", make_prompts()[0], SamplingParams(**bad))  # type: ignore[arg-type]
        assert err.value.field == field, bad
    assert engine.num_unfinished() == 0
