"""vLLM's allowed_token_ids under speculative decoding (workers/engine/allowed_tokens.py), on the one-layer tiny
target in float64 (eagle_models): greedy output keeps to its allowed tokens, differs from the free output, and
is token-identical with speculation on (draft chain and trees, n-gram, EAGLE) and off; a request in the same
batch without the rule is untouched; sampled output never leaves the set; bad lists are refused."""

from pathlib import Path

import pytest

from tests.workers.engine_runs import run_all, tokens
from tests.workers.spec.test_engine_grammar import METHODS, engine_for
from tests.workers.spec.test_engine_speculation import make_prompts
from workers.engine.errors import InvalidRequestError
from workers.engine.sampling_params import SamplingParams

FREE = "free"
MAX_TOKENS = 24
PROMPTS = make_prompts()[::10]


@pytest.fixture(scope="module")
def free(eagle_models: dict[str, Path]) -> dict[str, list[int]]:
    engine = engine_for(eagle_models, "none")
    requests = {str(i): (p, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
                for i, p in enumerate(PROMPTS)}  # fmt: skip
    return {rid: tokens(o) for rid, o in run_all(engine, requests).items()}


def allowed_of(free: dict[str, list[int]]) -> dict[str, list[int]]:
    """Each request's allowed tokens: its free output's second half, and a few others (its first token not)."""
    return {rid: sorted(set(toks[len(toks) // 2 :]) - {toks[0]} | {3, 5, 8, 13}) for rid, toks in free.items()}


def restricted(free: dict[str, list[int]]) -> dict[str, tuple[list[int], SamplingParams]]:
    requests = {
        rid: (PROMPTS[int(rid)], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True,
                                                 allowed_token_ids=allowed))
        for rid, allowed in allowed_of(free).items()
    }  # fmt: skip
    requests[FREE] = (PROMPTS[0], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    return requests


@pytest.fixture(scope="module")
def plain(eagle_models: dict[str, Path], free: dict[str, list[int]]) -> dict[str, list[int]]:
    engine = engine_for(eagle_models, "none")
    return {rid: tokens(o) for rid, o in run_all(engine, restricted(free)).items()}


def test_greedy_output_keeps_to_its_allowed_tokens(plain, free) -> None:
    for rid, allowed in allowed_of(free).items():
        assert set(plain[rid]) <= set(allowed) and plain[rid] != free[rid], rid
    assert plain[FREE] == free["0"]  # the free request in the same batch feels nothing


@pytest.mark.parametrize("method", [m for m in METHODS if m != "none"])
def test_greedy_restricted_output_is_the_same_with_speculation(eagle_models, free, plain, method) -> None:
    engine = engine_for(eagle_models, method)
    outs = run_all(engine, restricted(free))
    assert {rid: tokens(o) for rid, o in outs.items()} == plain
    assert engine.speculator.stats.counts.num_steps > 0  # it drafted


@pytest.mark.parametrize("method", ["draft-chain", "draft-tree-configured", "ngram", "eagle-chain"])
def test_sampled_output_never_leaves_the_set(eagle_models, method) -> None:
    engine = engine_for(eagle_models, method)
    allowed = list(range(100, 140))
    requests = {
        str(seed): (make_prompts()[seed], SamplingParams(max_tokens=32, temperature=1.5, seed=seed, ignore_eos=True,
                                                          allowed_token_ids=allowed))
        for seed in range(8)
    }  # fmt: skip
    outs = {rid: tokens(o) for rid, o in run_all(engine, requests).items()}
    assert all(len(t) == 32 and set(t) <= set(allowed) for t in outs.values())
    assert len({t for toks in outs.values() for t in toks}) > 10  # it sampled among them


def test_bad_lists_are_refused(eagle_models) -> None:
    engine = engine_for(eagle_models, "none")
    vocab = engine.runner.model.cfg.vocab_size
    eos = min(engine.eos_token_ids)
    for bad in (dict(allowed_token_ids=[]), dict(allowed_token_ids=[vocab]), dict(allowed_token_ids=[-1]),
                dict(allowed_token_ids=[eos], min_tokens=2, max_tokens=4)):  # fmt: skip
        with pytest.raises(InvalidRequestError) as err:
            engine.add_request("bad", make_prompts()[0], SamplingParams(**bad))  # type: ignore[arg-type]
        assert err.value.field == "allowed_token_ids", bad
    assert engine.num_unfinished() == 0
    out = run_all(engine, {"ok": (make_prompts()[0], SamplingParams(max_tokens=4, min_tokens=2, ignore_eos=True,
                                                                     allowed_token_ids=[eos]))})  # fmt: skip
    assert tokens(out["ok"]) == [eos] * 4  # EOS ends nothing here: min_tokens holds nothing back
