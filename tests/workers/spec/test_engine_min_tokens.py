"""vLLM's min_tokens and stop_token_ids under speculative decoding (workers/engine/min_tokens.py), on the one-layer
tiny target in float64 (eagle_models): a stop token pushed by logit_bias comes exactly at the min_tokens-th
position (never before), a stop string ending in the first min_tokens tokens' text does not stop the output (one
ending in a later token's does, vLLM's rule), greedy output is token-identical with speculation on and off,
`ignore_eos` leaves EOS alone, a resumed job counts the output it had, and bad values are refused."""

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


def free_run(engine) -> tuple[list[int], list[str]]:
    """A free greedy answer: its tokens and each one's text (plain decoding: one token a step)."""
    outs = run_all(engine, {"f": (make_prompts()[6], SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True))})
    assert all(len(o.new_token_ids) == 1 for o in outs["f"])
    return tokens(outs["f"]), [o.new_text for o in outs["f"]]


def held_stop(texts: list[str]) -> tuple[str, int]:
    """A character of the answer whose first occurrence ends in token m's text and which comes again after it:
    (the character, m)."""
    full, ends = "", []
    for text in texts:
        full += text
        ends.append(len(full))  # ends[k - 1]: the text's length after k tokens
    for char in dict.fromkeys(full):
        m = next(k + 1 for k, end in enumerate(ends) if end > full.index(char))
        if full.find(char, ends[m - 1]) >= 0:
            return char, m
    raise AssertionError(f"no character comes twice in {full!r}")


@pytest.mark.parametrize("method", ["none", "draft-chain", "ngram", "eagle-chain"])
def test_a_stop_string_in_the_first_min_tokens_tokens_does_not_stop(eagle_models, method) -> None:
    free_tokens, texts = free_run(engine_for(eagle_models, "none"))
    stop, m = held_stop(texts)
    full = "".join(texts)
    second = full.find(stop, len("".join(texts[:m])))
    j = next(k for k in range(m + 1, len(texts) + 1) if len("".join(texts[:k])) > second)  # the token it ends in
    engine = engine_for(eagle_models, method)
    prompt = make_prompts()[6]
    outs = run_all(engine, {
        "plain": (prompt, SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True, stop=[stop])),
        "held": (prompt, SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True, stop=[stop], min_tokens=m)),
        "one-less": (prompt, SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True, stop=[stop],
                                            min_tokens=m - 1)),
    })  # fmt: skip
    assert tokens(outs["plain"]) == free_tokens[:m] == tokens(outs["one-less"])  # token m may stop: m - 1 before it
    assert "".join(o.new_text for o in outs["plain"]) == full[: full.index(stop)]
    assert tokens(outs["held"]) == free_tokens[:j]  # token m's stop is held: the next one ends it
    assert "".join(o.new_text for o in outs["held"]) == full[:second]
    assert outs["held"][-1].finish_reason == "stop"
