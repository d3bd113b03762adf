"""OpenAI's presence and frequency penalties and vLLM's repetition penalty under speculative decoding
(workers/engine/penalties.py), on the one-layer tiny target in float64 (eagle_models): plain greedy decoding
with penalties is the reference decode loop over transformers' logits with the same rules; greedy penalized
output is token-identical with speculation on (draft chain, trees configured: penalized sequences draft chains,
n-gram, EAGLE chain) and off, and differs from the unpenalized output; a request in the same batch without
penalties is untouched; a resumed job counts the output it already had; bad values are refused."""

from pathlib import Path

import pytest
import torch
import transformers

from tests.workers.engine_runs import run_all, tokens
from tests.workers.spec.test_engine_grammar import METHODS, engine_for
from tests.workers.spec.test_engine_speculation import make_prompts
from workers.engine.errors import InvalidRequestError
from workers.engine.sampling_params import SamplingParams

MAX_TOKENS = 24
FREE = "free"  # the request of each batch without penalties
PENALTIES = {  # each request's penalties, by name
    "frequency": dict(frequency_penalty=1.5),
    "presence": dict(presence_penalty=2.0),
    "negative": dict(frequency_penalty=-0.5, presence_penalty=-1.0),  # rewards repeating
    "repetition": dict(repetition_penalty=1.8),
    "all": dict(frequency_penalty=0.7, presence_penalty=0.4, repetition_penalty=1.3),
}


def prompts() -> dict[str, list[int]]:
    chosen = make_prompts()[::9]
    return {name: chosen[i % len(chosen)] for i, name in enumerate([*PENALTIES, FREE])}


def requests() -> dict[str, tuple[list[int], SamplingParams]]:
    out = {
        name: (prompts()[name], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, **kw))
        for name, kw in PENALTIES.items()
    }
    out[FREE] = (prompts()[FREE], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    return out


def reference(target_dir: Path, prompt: list[int], frequency_penalty: float = 0.0, presence_penalty: float = 0.0,
              repetition_penalty: float = 1.0) -> list[int]:  # fmt: skip
    """Greedy decoding over transformers' logits (float64) with the penalties written out as OpenAI and vLLM
    define them: counts over the output, the repetition penalty over prompt and output."""
    model = transformers.AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float64).eval()
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(MAX_TOKENS):
            logits = model(torch.tensor([ids])).logits[0, -1].clone()  # [V]
            output = ids[len(prompt):]
            for t in set(ids):
                if repetition_penalty != 1.0:
                    logits[t] = logits[t] / repetition_penalty if logits[t] > 0 else logits[t] * repetition_penalty
            for t in set(output):
                logits[t] -= frequency_penalty * output.count(t) + presence_penalty
            ids.append(int(logits.argmax()))
    return ids[len(prompt):]


@pytest.fixture(scope="module")
def plain(eagle_models: dict[str, Path]) -> dict[str, list[int]]:
    engine = engine_for(eagle_models, "none")
    return {rid: tokens(o) for rid, o in run_all(engine, requests()).items()}


def test_plain_penalized_decoding_is_the_reference_loop(eagle_models, plain) -> None:
    for name, kw in PENALTIES.items():
        want = reference(eagle_models["target"], prompts()[name], **kw)  # type: ignore[arg-type]
        assert plain[name] == want, name
        assert want != reference(eagle_models["target"], prompts()[name]), name  # the penalty changed it
    assert plain[FREE] == reference(eagle_models["target"], prompts()[FREE])


@pytest.mark.parametrize("method", [m for m in METHODS if m not in ("none", "eagle-draft-vocab")])
def test_greedy_penalized_output_is_the_same_with_speculation(eagle_models, plain, method) -> None:
    engine = engine_for(eagle_models, method)
    outs = run_all(engine, requests())
    assert {rid: tokens(o) for rid, o in outs.items()} == plain
    counts = engine.speculator.stats.counts
    assert counts.num_steps > 0 and counts.num_accepted > 0  # it drafted, and kept some


def test_a_resumed_job_counts_the_output_it_had(eagle_models, plain) -> None:
    """A job resumed on another worker sends prompt + its output so far (num_resumed_tokens): the penalties
    count that output as output, so the rest is what the uninterrupted job gives."""
    engine = engine_for(eagle_models, "draft-chain")
    done = plain["frequency"]
    params = SamplingParams(max_tokens=MAX_TOKENS - 6, temperature=0.0, ignore_eos=True, num_resumed_tokens=6,
                            **PENALTIES["frequency"])  # type: ignore[arg-type]
    out = run_all(engine, {"r": (prompts()["frequency"] + done[:6], params)})["r"]
    assert done[:6] + tokens(out) == done


def test_bad_penalties_are_refused(eagle_models) -> None:
    engine = engine_for(eagle_models, "none")
    for bad in (dict(presence_penalty=2.5), dict(frequency_penalty=-3.0), dict(repetition_penalty=0.0),
                dict(repetition_penalty=11.0), dict(frequency_penalty=float("nan"))):  # fmt: skip
        with pytest.raises(InvalidRequestError) as err:
            engine.add_request("bad", make_prompts()[0], SamplingParams(**bad))  # type: ignore[arg-type]
        assert err.value.field == next(iter(bad)), bad
    assert engine.num_unfinished() == 0
