"""Logprobs (output tokens, and prompt tokens for echo) come from the target's own verification logits and equal
transformers' log-softmax of the target over the same tokens, within 1e-4 in fp32, whether the tokens came from
plain decoding or were accepted from a draft (draft chain, draft tree, n-gram)."""

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from shared.speculation import SpeculativeMethod
from tests.workers.engine_runs import make_engine, run_all, spec_engine, tokens
from workers.engine.engine import Engine
from workers.engine.errors import InvalidRequestError
from workers.engine.outputs import StepOutput, TokenLogprob
from workers.engine.sampling_params import SamplingParams

TOLERANCE = 1e-4
NUM_TOP = 5
PROMPTS = {  # token ids; the long one prefills in several chunks (max_num_batched_tokens below)
    "short": [5, 17, 99, 3],
    "long": [(i * 37 + 11) % 200 + 4 for i in range(30)],
    "loop": [40, 41, 42, 43] * 4,  # repetition: n-gram lookup finds matches
}
VARIANTS = {
    "plain": dict(speculative_method=SpeculativeMethod.NONE),
    "draft_chain": dict(speculative_method=SpeculativeMethod.DRAFT),
    "draft_tree": dict(speculative_method=SpeculativeMethod.DRAFT, tree_size=6),
    "ngram": dict(speculative_method=SpeculativeMethod.NGRAM),
}


def requests() -> dict[str, tuple[list[int], SamplingParams]]:
    made = {}
    for name, prompt in PROMPTS.items():
        greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=NUM_TOP, prompt_logprobs=NUM_TOP)
        made[f"{name}-greedy"] = (prompt, greedy)
        sampled = SamplingParams(max_tokens=16, temperature=0.7, top_k=20, seed=7, ignore_eos=True, logprobs=2)
        made[f"{name}-sampled"] = (prompt, sampled)  # raw logprobs: before temperature and top-k
    return made


@pytest.fixture(scope="module")
def reference(spec_models: dict[str, Path]) -> AutoModelForCausalLM:
    return AutoModelForCausalLM.from_pretrained(spec_models["target"], dtype=torch.float32).eval()


def log_softmax_of(model: AutoModelForCausalLM, token_ids: list[int]) -> torch.Tensor:
    """[len - 1, V] transformers' log-softmax of the target: row i scores token i + 1."""
    with torch.no_grad():
        logits = model(torch.tensor([token_ids])).logits[0].float()  # [len, V]
    return torch.log_softmax(logits, dim=-1)[:-1]


def check_close(got: TokenLogprob, want: torch.Tensor, token_id: int, num_top: int) -> None:
    """want: [V] the reference's log-softmax at the position that scored token_id."""
    assert got.token_id == token_id
    assert got.logprob is not None and abs(got.logprob - float(want[token_id])) < TOLERANCE
    assert len(got.top) == num_top
    top_values = want.topk(num_top).values
    for (top_id, top_logprob), want_value in zip(got.top, top_values.tolist(), strict=True):
        assert abs(top_logprob - want_value) < TOLERANCE  # the same values, best first
        assert abs(top_logprob - float(want[top_id])) < TOLERANCE  # and each one is its token's


Run = tuple[dict[str, list[StepOutput]], Engine]


@pytest.fixture(scope="module")
def runs(spec_models: dict[str, Path]) -> dict[str, Run]:
    """variant -> (each request's outputs, the engine), every request of requests() run together (fp32)."""
    made = {}
    for variant, overrides in VARIANTS.items():
        settings = dict(dtype="float32", max_num_batched_tokens=8, **overrides)
        if variant == "plain":
            engine = make_engine(spec_models["target"], **settings)
        else:
            engine = spec_engine(spec_models, **settings)
        made[variant] = (run_all(engine, requests()), engine)
    return made


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logprobs_are_the_targets_log_softmax(
    runs: dict[str, Run], reference: AutoModelForCausalLM, variant: str
) -> None:
    outputs, engine = runs[variant]
    for rid, (prompt, params) in requests().items():
        outs = outputs[rid]
        generated = tokens(outs)
        logprobs = [lp for o in outs for lp in (o.new_logprobs or [])]
        assert len(logprobs) == len(generated) == 16
        want = log_softmax_of(reference, prompt + generated)  # [len - 1, V]
        for i, (got, token_id) in enumerate(zip(logprobs, generated, strict=True)):
            check_close(got, want[len(prompt) - 1 + i], token_id, params.logprobs or 0)
        prompt_logprobs = [o.prompt_logprobs for o in outs if o.prompt_logprobs is not None]
        if params.prompt_logprobs is None:
            assert prompt_logprobs == []
            continue
        assert len(prompt_logprobs) == 1 and prompt_logprobs[0] is outs[0].prompt_logprobs  # once, with the first
        echoed = prompt_logprobs[0]
        assert len(echoed) == len(prompt) and echoed[0] == TokenLogprob(prompt[0], None)
        for position in range(1, len(prompt)):
            check_close(echoed[position], want[position - 1], prompt[position], NUM_TOP)
    if variant != "plain":  # the tokens checked above include accepted draft tokens
        assert engine.speculator.stats.counts.num_accepted > 0


def test_speculation_does_not_change_them(runs: dict[str, Run]) -> None:
    """The greedy tokens and their logprobs agree across methods (the sampled ones may differ in tokens)."""
    for rid in (r for r in requests() if r.endswith("greedy")):
        plain = [lp for o in runs["plain"][0][rid] for lp in o.new_logprobs or []]
        for variant in ("draft_chain", "draft_tree", "ngram"):
            other = [lp for o in runs[variant][0][rid] for lp in o.new_logprobs or []]
            assert [lp.token_id for lp in other] == [lp.token_id for lp in plain]
            assert max(abs((a.logprob or 0) - (b.logprob or 0)) for a, b in zip(plain, other, strict=True)) < TOLERANCE


def test_no_logprobs_unless_asked_and_bad_values_are_refused(spec_models: dict[str, Path]) -> None:
    engine = make_engine(spec_models["target"])
    outs = run_all(engine, {"r": ([5, 6, 7], SamplingParams(max_tokens=4, temperature=0.0))})["r"]
    assert all(o.new_logprobs is None and o.prompt_logprobs is None for o in outs)
    for bad in (dict(logprobs=21), dict(logprobs=-1), dict(prompt_logprobs=True)):
        with pytest.raises(InvalidRequestError):
            engine.add_request("bad", [5], SamplingParams(**bad))  # type: ignore[arg-type]
