"""OpenAI's logit_bias under speculative decoding (workers/engine/logit_bias.py), on the one-layer tiny target
in float64 (eagle_models: a close draft and a near-copy EAGLE head): greedy biased output is token-identical
with speculation on (draft chain, trees configured, n-gram, EAGLE chain) and off, and differs from the
unbiased output; a request in the same batch without a bias is untouched; a banned token never comes, even
sampled; +100 forces its token; the logprobs stay the target's raw ones; a bias naming a token the model does
not have is refused."""

from pathlib import Path

import pytest

from tests.workers.engine_runs import run_all, tokens
from tests.workers.spec.test_engine_grammar import METHODS, engine_for
from tests.workers.spec.test_engine_speculation import make_prompts
from workers.engine.errors import InvalidRequestError
from workers.engine.sampling_params import SamplingParams

FREE = "free"  # the request of each batch without a bias
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def unbiased(eagle_models: dict[str, Path]) -> dict[str, list[int]]:
    """request id -> the tokens plain greedy decoding gives without a bias."""
    engine = engine_for(eagle_models, "none")
    requests = {str(i): (p, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
                for i, p in enumerate(make_prompts()[::10])}  # fmt: skip
    return {rid: tokens(o) for rid, o in run_all(engine, requests).items()}


def biases(unbiased: dict[str, list[int]]) -> dict[str, dict[int, float]]:
    """Each request's bias: its unbiased output's most frequent tokens banned, and a push toward two others."""
    out = {}
    for rid, toks in unbiased.items():
        common = [t for t, _ in sorted(((t, -toks.count(t)) for t in set(toks)), key=lambda x: (x[1], x[0]))][:3]
        out[rid] = {**{t: -100.0 for t in common}, 7: 2.5, 11: 4.0}
    return out


def biased_requests(unbiased: dict[str, list[int]]) -> dict[str, tuple[list[int], SamplingParams]]:
    prompts = make_prompts()[::10]
    requests = {
        rid: (prompts[int(rid)], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logit_bias=b))
        for rid, b in biases(unbiased).items()
    }
    requests[FREE] = (prompts[0], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    return requests


@pytest.fixture(scope="module")
def plain(eagle_models: dict[str, Path], unbiased: dict[str, list[int]]) -> dict[str, list[int]]:
    engine = engine_for(eagle_models, "none")
    return {rid: tokens(o) for rid, o in run_all(engine, biased_requests(unbiased)).items()}


def test_the_bias_changes_greedy_output_and_bans_its_tokens(plain, unbiased) -> None:
    for rid, bias in biases(unbiased).items():
        assert plain[rid] != unbiased[rid]
        banned = {t for t, b in bias.items() if b == -100.0}
        assert not banned & set(plain[rid]), (rid, plain[rid])
    assert plain[FREE] == unbiased["0"]  # the unbiased request in the same batch feels nothing


@pytest.mark.parametrize("method", [m for m in METHODS if m not in ("none", "eagle-draft-vocab")])
def test_greedy_biased_output_is_the_same_with_speculation(eagle_models, unbiased, plain, method) -> None:
    engine = engine_for(eagle_models, method)
    outs = run_all(engine, biased_requests(unbiased))
    assert {rid: tokens(o) for rid, o in outs.items()} == plain
    counts = engine.speculator.stats.counts
    assert counts.num_steps > 0 and counts.num_accepted > 0  # it drafted, and kept some


@pytest.mark.parametrize("method", ["draft-chain", "ngram", "eagle-chain"])
def test_sampled_output_never_has_a_banned_token(eagle_models, method) -> None:
    engine = engine_for(eagle_models, method)
    banned = set(range(0, 40))
    requests = {
        str(seed): (make_prompts()[seed], SamplingParams(max_tokens=32, temperature=1.5, seed=seed, ignore_eos=True,
                                                          logit_bias={t: -100.0 for t in banned}))
        for seed in range(8)
    }
    for rid, o in run_all(engine, requests).items():
        assert len(tokens(o)) == 32 and not banned & set(tokens(o)), (rid, tokens(o))


def test_plus_100_forces_its_token_and_logprobs_stay_raw(eagle_models) -> None:
    engine = engine_for(eagle_models, "draft-chain")
    prompt = make_prompts()[3]
    forced = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logit_bias={42: 100.0}, logprobs=1)
    raw = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, logprobs=1)
    outs = run_all(engine, {"forced": (prompt, forced), "raw": (prompt, raw)})
    assert tokens(outs["forced"]) == [42] * 12
    first = outs["forced"][0].new_logprobs[0]  # type: ignore[index]
    unforced = outs["raw"][0].new_logprobs[0]  # type: ignore[index]
    assert unforced.token_id != 42  # the bias made the choice
    assert first.token_id == 42 and first.top == unforced.top  # the target's own distribution, not the biased one
    assert first.logprob is not None and first.logprob < unforced.top[0][1]


def test_a_bias_the_model_cannot_take_is_refused(eagle_models) -> None:
    engine = engine_for(eagle_models, "none")
    vocab = engine.runner.model.cfg.vocab_size
    for bad in ({vocab: 1.0}, {-1: 1.0}, {3: 100.5}, {3: float("nan")}, {i: 1.0 for i in range(301)}):
        with pytest.raises(InvalidRequestError) as err:
            engine.add_request("bad", make_prompts()[0], SamplingParams(logit_bias=bad))
        assert err.value.field == "logit_bias", bad
    assert engine.num_unfinished() == 0
