"""Engine behaviour on tiny random models: batching, preemption, sampling, stops, errors, abort."""

from pathlib import Path

import pytest
import torch

from shared.schemas import MAX_SEED, MAX_TOP_K, MIN_SEED
from shared.speculation import SpeculativeMethod
from tests.workers.engine_runs import greedy, make_engine, run_all, tokens
from workers.engine.config import EngineConfig
from workers.engine.engine import Engine
from workers.engine.errors import InvalidRequestError, PromptTooLongError
from workers.engine.sampling_params import SamplingParams


def prompts(n: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(1, 512, (int(3 + 9 * i) % 61 + 1,), generator=gen).tolist() for i in range(n)]


def test_batched_output_equals_unbatched(tiny_models: dict[str, Path]) -> None:
    # float64 so that the comparison tests the batching logic, not float32 rounding of different kernels
    engine = make_engine(tiny_models["llama"], dtype="float64")
    ps = prompts(17)
    alone = run_all(engine, {"solo": (ps[0], greedy(40))})["solo"]
    batch = run_all(engine, {f"r{i}": (p, greedy(40 - i)) for i, p in enumerate(ps)})
    assert tokens(batch["r0"]) == tokens(alone)
    for i, p in enumerate(ps[1:], start=1):
        assert tokens(run_all(engine, {"x": (p, greedy(40 - i))})["x"]) == tokens(batch[f"r{i}"])


def test_preemption_under_a_small_kv_budget_loses_nothing(tiny_models: dict[str, Path]) -> None:
    ps = prompts(8)
    requests = {f"r{i}": (p, greedy(24)) for i, p in enumerate(ps)}
    roomy = run_all(make_engine(tiny_models["llama"], dtype="float64"), requests)
    # 4 KiB per block in float64: 32 blocks of 4 tokens cannot hold 8 sequences of 28 to 82 tokens at once
    tight_engine = make_engine(tiny_models["llama"], dtype="float64", kv_cache_mb=128 / 1024)
    tight = run_all(tight_engine, requests)
    assert sum(o[-1].metrics["num_preemptions"] for o in tight.values()) > 0
    for rid in requests:
        assert tight[rid][-1].finish_reason == "length"
        assert tokens(tight[rid]) == tokens(roomy[rid])
    assert tight_engine.block_manager.num_free_blocks == tight_engine.block_manager.num_blocks


def test_long_prompt_is_prefilled_in_chunks(tiny_models: dict[str, Path]) -> None:
    prompt = prompts(40)[-1] * 3  # > 100 tokens
    whole = run_all(make_engine(tiny_models["qwen2"]), {"a": (prompt, greedy(16))})["a"]
    chunked_engine = make_engine(tiny_models["qwen2"], max_num_batched_tokens=16)
    chunked = run_all(chunked_engine, {"a": (prompt, greedy(16))})["a"]
    assert tokens(chunked) == tokens(whole)


def test_seeded_sampling_reproduces_whatever_the_batch(tiny_models: dict[str, Path]) -> None:
    engine = make_engine(tiny_models["llama"], dtype="float64")
    params = SamplingParams(max_tokens=30, temperature=0.9, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    p = prompts(1)[0]
    alone = tokens(run_all(engine, {"s": (p, params)})["s"])
    others = {
        f"o{i}": (q, SamplingParams(max_tokens=20, temperature=1.0, ignore_eos=True))
        for i, q in enumerate(prompts(6))
    }
    crowd = run_all(engine, {"s": (p, params), **others})
    assert tokens(crowd["s"]) == alone
    other_seed = SamplingParams(max_tokens=30, temperature=0.9, top_p=0.9, top_k=50, seed=99, ignore_eos=True)
    assert tokens(run_all(engine, {"t": (p, other_seed)})["t"]) != alone


def test_stop_token_ids_and_eos_finish_with_stop(tiny_models: dict[str, Path]) -> None:
    engine = make_engine(tiny_models["llama"])
    p = prompts(1)[0]
    free_run = tokens(run_all(engine, {"a": (p, greedy(20))})["a"])
    stop_at = free_run[5]
    outs = run_all(
        engine, {"b": (p, SamplingParams(max_tokens=20, temperature=0.0, stop_token_ids=[stop_at]))}
    )["b"]
    assert outs[-1].finish_reason == "stop"
    assert tokens(outs) == free_run[: free_run.index(stop_at) + 1]
    engine.eos_token_ids = frozenset({stop_at})
    outs = run_all(engine, {"c": (p, SamplingParams(max_tokens=20, temperature=0.0))})["c"]
    assert outs[-1].finish_reason == "stop" and tokens(outs)[-1] == stop_at


def test_stop_string_ends_generation_and_text(tiny_models: dict[str, Path]) -> None:
    engine = make_engine(tiny_models["llama"])
    p = prompts(1)[0]
    free = run_all(engine, {"a": (p, greedy(30))})["a"]
    text = "".join(o.new_text for o in free)
    stop = text[10:14]
    outs = run_all(engine, {"b": (p, SamplingParams(max_tokens=30, temperature=0.0, stop=[stop]))})["b"]
    assert outs[-1].finish_reason == "stop"
    assert "".join(o.new_text for o in outs) == text[: text.index(stop)]
    kept = SamplingParams(max_tokens=30, temperature=0.0, stop=[stop], include_stop_str_in_output=True)
    with_stop = run_all(engine, {"c": (p, kept)})["c"]  # vLLM's include_stop_str_in_output
    assert [o.new_token_ids for o in with_stop] == [o.new_token_ids for o in outs]  # the same tokens
    assert with_stop[-1].finish_reason == "stop"
    assert "".join(o.new_text for o in with_stop) == text[: text.index(stop) + len(stop)]


def test_skip_special_tokens_off_leaves_their_text(tiny_models: dict[str, Path]) -> None:
    """vLLM's skip_special_tokens: EOS (pushed by logit_bias, run past with ignore_eos) leaves no text by
    default, and its own text with the parameter off; the tokens are the same."""
    engine = make_engine(tiny_models["llama"])
    eos = min(engine.eos_token_ids)
    eos_text = engine.tokenizer.decode([eos], skip_special_tokens=False)
    assert eos_text and engine.tokenizer.decode([eos], skip_special_tokens=True) == ""
    p = prompts(1)[0]
    runs = {skip: run_all(engine, {"a": (p, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True,
                                                           logit_bias={eos: 100.0}, skip_special_tokens=skip))})["a"]
            for skip in (True, False)}  # fmt: skip
    assert [t for o in runs[True] for t in o.new_token_ids] == [eos] * 6 == [t for o in runs[False] for t in o.new_token_ids]
    assert "".join(o.new_text for o in runs[True]) == "" and "".join(o.new_text for o in runs[False]) == eos_text * 6


def test_metrics_and_counts_on_finish(tiny_models: dict[str, Path]) -> None:
    engine = make_engine(tiny_models["llama"])
    outs = run_all(engine, {"a": ([1, 2, 3], greedy(12))})["a"]
    last = outs[-1]
    assert last.finished and last.num_prompt_tokens == 3 and last.num_output_tokens == 12
    assert last.metrics["ttft_ms"] > 0 and last.metrics["tokens_per_s"] > 0


def test_abort_frees_blocks_and_stops_output(tiny_models: dict[str, Path]) -> None:
    engine = make_engine(tiny_models["llama"])
    engine.add_request("a", prompts(1)[0], greedy(50))
    engine.step()
    engine.step()
    assert engine.block_manager.num_free_blocks < engine.block_manager.num_blocks
    assert engine.abort("a") is True
    assert engine.abort("a") is False and engine.abort("nope") is False
    assert engine.step() == [] and engine.num_unfinished() == 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_free_capacity_counts_sequence_slots(tiny_models: dict[str, Path]) -> None:
    engine = make_engine(tiny_models["llama"], max_num_seqs=3)
    assert engine.free_capacity() == 3
    engine.add_request("a", [1, 2], greedy(5))
    assert engine.free_capacity() == 0  # waiting requests come first
    engine.step()
    assert engine.free_capacity() == 2


def test_room_after_waiting_counts_new_requests_as_started_unless_a_step_left_one_waiting(
    tiny_models: dict[str, Path],
) -> None:
    engine = make_engine(tiny_models["llama"], max_num_seqs=3)
    engine.add_request("a", [1, 2], greedy(5))
    assert engine.free_capacity() == 0 and engine.room_after_waiting() == 2  # "a" starts at the next step
    engine.step()
    assert engine.room_after_waiting() == engine.free_capacity() == 2

    tight = make_engine(tiny_models["llama"], max_num_seqs=4, kv_cache_mb=8 / 1024)  # 8 blocks of 4 tokens
    for name in "abc":
        tight.add_request(name, list(range(1, 10)), greedy(3))  # 3 blocks each: one fits with room to grow
    assert tight.room_after_waiting() == 1
    tight.step()
    assert len(tight.scheduler.waiting) == 2  # KV ran short: no room, though slots are free
    assert tight.room_after_waiting() == 0 and tight.free_capacity() == 0


@pytest.mark.parametrize(
    ("prompt", "params", "field", "error"),
    [
        ("", SamplingParams(), "prompt", InvalidRequestError),
        ([], SamplingParams(), "prompt", InvalidRequestError),
        ([1, 99999], SamplingParams(), "prompt", InvalidRequestError),
        ([1] * 600, SamplingParams(max_tokens=1), "prompt", PromptTooLongError),
        ([1, 2], SamplingParams(max_tokens=600), "max_tokens", PromptTooLongError),
        ("hi", SamplingParams(max_tokens=0), "max_tokens", InvalidRequestError),
        ("hi", SamplingParams(temperature=-0.5), "temperature", InvalidRequestError),
        ("hi", SamplingParams(top_p=0.0), "top_p", InvalidRequestError),
        ("hi", SamplingParams(top_p=1.5), "top_p", InvalidRequestError),
        ("hi", SamplingParams(top_k=-3), "top_k", InvalidRequestError),
        ("hi", SamplingParams(include_stop_str_in_output=1), "include_stop_str_in_output", InvalidRequestError),  # type: ignore[arg-type]
        ("hi", SamplingParams(top_k=2**63), "top_k", InvalidRequestError),  # past a long tensor: failed in a step
        ("hi", SamplingParams(seed=2**64), "seed", InvalidRequestError),  # past torch's generators
        ("hi", SamplingParams(seed=-(2**63) - 1), "seed", InvalidRequestError),
        ("hi", SamplingParams(stop=[1]), "stop", InvalidRequestError),  # type: ignore[list-item]
        ("hi", SamplingParams(stop={"a": 1}), "stop", InvalidRequestError),  # type: ignore[arg-type]
        ("hi", SamplingParams(stop_token_ids=["x"]), "stop_token_ids", InvalidRequestError),  # type: ignore[list-item]
        ("hi", SamplingParams(speculative="maybe"), "speculative", InvalidRequestError),
    ],
)
def test_bad_requests_raise_typed_errors(tiny_models: dict[str, Path], prompt, params, field, error) -> None:
    engine = make_engine(tiny_models["llama"])
    with pytest.raises(error) as info:
        engine.add_request("bad", prompt, params)
    assert info.value.field == field and info.value.message
    assert engine.num_unfinished() == 0


def test_the_widest_seed_and_top_k_are_sampled(tiny_models: dict[str, Path]) -> None:
    """The bounds of the ranges above run: a top_k past the vocabulary keeps every token; the two seeds that are
    one 64-bit pattern draw the same tokens."""
    sampled = {name: SamplingParams(max_tokens=6, temperature=1.0, seed=seed, top_k=MAX_TOP_K)
               for name, seed in (("high", MAX_SEED), ("low", MIN_SEED), ("same", 2**63))}  # fmt: skip
    out = run_all(make_engine(tiny_models["llama"]), {name: ([1, 2, 3], params) for name, params in sampled.items()})
    assert all(len(tokens(out[r])) == 6 for r in ("high", "low", "same"))
    assert tokens(out["low"]) == tokens(out["same"])


def test_a_temperature_too_small_for_float32_decodes_greedily(tiny_models: dict[str, Path]) -> None:
    """The logits over 1e-40 overflow float32: the probabilities were NaN, and the request got token 0."""
    requests = {"tiny_t": ([1, 2, 3], SamplingParams(max_tokens=8, temperature=1e-40, seed=3, ignore_eos=True)),
                "greedy": ([1, 2, 3], greedy(8))}  # fmt: skip
    out = run_all(make_engine(tiny_models["llama"]), requests)
    assert tokens(out["tiny_t"]) == tokens(out["greedy"]) and len(tokens(out["greedy"])) == 8


def test_request_larger_than_the_whole_kv_cache_is_refused(tiny_models: dict[str, Path]) -> None:
    engine = make_engine(tiny_models["llama"], kv_cache_mb=8 / 1024)  # 8 blocks of 4 tokens
    with pytest.raises(PromptTooLongError):
        engine.add_request("big", [1] * 20, greedy(20))


def test_the_draft_method_needs_a_draft_model(tiny_models: dict[str, Path]) -> None:
    with pytest.raises(ValueError, match="no draft model"):
        make_engine(tiny_models["llama"], speculative_method="draft")
    # unset (a worker given a target alone), the method is the best the engine holds: n-gram lookup here
    engine = Engine.from_config(EngineConfig(target_dir=str(tiny_models["llama"]), kv_cache_mb=4, num_threads=1))
    assert EngineConfig().speculative_method is None
    assert engine.cfg.speculative_method is SpeculativeMethod.NGRAM
    out = run_all(engine, {"a": ([5, 9, 14, 5, 9, 14, 5, 9], greedy(8))})["a"]
    assert out[-1].metrics["num_spec_steps"] > 0  # it speculated
