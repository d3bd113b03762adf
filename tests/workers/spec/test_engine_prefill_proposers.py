"""The draft model and the EAGLE head take in a prompt as the target prefills it (Speculator.prefill): after
the prefill step the draft holds the prompt's K/V and the head every row but the last committed one, chunk by
chunk under a small token budget, so a sequence's first proposal catches up on a token or two; greedy output
stays token-identical to plain decoding."""

from pathlib import Path

import pytest

from tests.workers.engine_runs import greedy, run_all, spec_engine, tokens
from tests.workers.spec.test_engine_speculation import make_prompts
from workers.engine.engine import Engine


def prefill_only(engine: Engine, prompt: list[int]) -> None:
    """Add one request and step until its prompt is computed (its first token sampled)."""
    engine.add_request("p", prompt, greedy(16))
    while engine.sequences["p"].num_output_tokens == 0:
        engine.step()


@pytest.mark.parametrize("budget", [512, 8])  # whole, and in chunks of 8
def test_the_draft_model_takes_in_the_prompt_at_prefill(spec_models: dict[str, Path], budget: int) -> None:
    engine = spec_engine(spec_models, speculative_method="draft", max_num_batched_tokens=budget)
    prompt = make_prompts()[3] * 3
    prefill_only(engine, prompt)
    seq = engine.sequences["p"]
    assert seq.spec is not None and seq.spec.draft_num_computed == len(prompt) == seq.num_computed_tokens


@pytest.mark.parametrize("budget", [512, 8])
def test_the_head_takes_in_the_prompt_at_prefill(eagle_models: dict[str, Path], budget: int) -> None:
    engine = spec_engine(
        eagle_models, draft=None, eagle="copy_head", speculative_method="eagle", max_num_batched_tokens=budget
    )
    prompt = make_prompts()[3] * 3
    prefill_only(engine, prompt)
    spec = engine.sequences["p"].spec
    assert spec is not None
    assert spec.draft_num_computed == len(prompt) - 1  # rows 0 .. P - 2; row P - 1 is the first proposal's
    assert spec.features_start == len(prompt) - 1 and spec.features_end == len(prompt)  # only its feature kept


@pytest.mark.parametrize("method", ["draft", "eagle"])
def test_outputs_are_unchanged_with_chunked_prefill(spec_models, eagle_models, method: str) -> None:
    models = eagle_models if method == "eagle" else spec_models
    extra = dict(draft=None, eagle="copy_head") if method == "eagle" else {}
    prompts = {str(i): (p * 2, greedy(20)) for i, p in enumerate(make_prompts()[:12])}
    plain = run_all(spec_engine(models, speculative_method="none", **extra), prompts)
    chunked = spec_engine(models, speculative_method=method, max_num_batched_tokens=12, **extra)
    outs = run_all(chunked, prompts)
    assert {r: tokens(o) for r, o in outs.items()} == {r: tokens(o) for r, o in plain.items()}
    assert chunked.speculator.stats.counts.num_accepted > 0
