"""Automatic prefix caching (workers/engine/prefix_cache.py, block_manager.py) on the one-layer tiny target in
float64 (eagle_models; blocks of 4 tokens): requests whose first blocks another request computed take those
blocks, and their greedy output is token-identical to an engine without the cache, plainly and under every
proposer; a chat's next turn takes its previous turn's prompt and answer; a seeded sample is the same; KV
pressure and preemption keep every block counted once; a request for its prompt's logprobs computes them all."""

from pathlib import Path

import pytest
import torch

from tests.workers.engine_runs import run_all, spec_engine, tokens
from tests.workers.spec.test_engine_grammar import METHODS, engine_for
from workers.engine.engine import Engine
from workers.engine.errors import InvalidRequestError
from workers.engine.outputs import StepOutput
from workers.engine.prefix_cache import FEATURES
from workers.engine.sampling_params import SamplingParams

SHARED = torch.randint(1, 512, (37,), generator=torch.Generator().manual_seed(11)).tolist()  # 9 full blocks + 1
TAILS = [[7, 9], [300, 2, 5, 8, 1], [44], [12, 13, 14, 15, 16, 17, 18, 19, 20]]


def greedy(max_tokens: int = 20) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def rounds(engine: Engine, params: SamplingParams | None = None, preemptions: list[float] | None = None) -> dict[str, list[int]]:
    """The shared prompt alone first, then the prompts that extend it, in one batch: request id -> tokens (and
    each request's preemptions appended to `preemptions`)."""
    params = params or greedy()
    first = run_all(engine, {"first": (SHARED, params)})
    rest = run_all(engine, {f"tail{i}": (SHARED + tail, params) for i, tail in enumerate(TAILS)})
    if preemptions is not None:
        preemptions += [outs[-1].metrics["num_preemptions"] for outs in {**first, **rest}.values()]
    return {rid: tokens(outs) for rid, outs in {**first, **rest}.items()}


def check_blocks(engine: Engine) -> None:
    """Every block is either free (no table holds it) or held as often as the tables that hold it say."""
    manager = engine.block_manager
    held = [0] * manager.num_blocks
    for seq in engine.sequences.values():
        for block in seq.block_table:
            held[block] += 1
    assert held == manager.refcounts
    assert set(manager.free_block_ids) == {b for b in range(manager.num_blocks) if held[b] == 0}


@pytest.fixture(scope="module")
def uncached(eagle_models: dict[str, Path]) -> dict[str, list[int]]:
    return rounds(engine_for(eagle_models, "none", prefix_caching=False))


@pytest.mark.parametrize("method", list(METHODS))
def test_requests_that_share_a_prefix_take_its_blocks_and_answer_the_same(eagle_models, uncached, method) -> None:
    engine = engine_for(eagle_models, method)
    assert rounds(engine) == uncached
    cache = engine.block_manager.cache
    assert cache is not None and cache.num_hit_tokens >= len(TAILS) * 36 - 4, cache.num_hit_tokens
    assert engine.speculator.stats.num_fallbacks == 0  # the proposers took the claimed blocks in stride
    check_blocks(engine)


def test_outputs_say_how_many_prompt_tokens_came_from_the_cache(eagle_models) -> None:
    engine = engine_for(eagle_models, "none")
    first = run_all(engine, {"a": (SHARED, greedy())})["a"]
    again = run_all(engine, {"b": (SHARED + [5, 6, 7], greedy())})["b"]
    assert first[-1].num_cached_tokens == 0 and again[-1].num_cached_tokens == 36  # 9 blocks of 4
    last_block_only = run_all(engine, {"c": (SHARED[:36], greedy())})["c"]
    assert last_block_only[-1].num_cached_tokens == 32  # the last token is always computed: its block too


@pytest.mark.parametrize("method", ["none", "draft-chain", "eagle-chain"])
def test_a_chat_s_next_turn_takes_its_previous_prompt_and_answer(eagle_models, method) -> None:
    cached, plain = engine_for(eagle_models, method), engine_for(eagle_models, method, prefix_caching=False)
    answers = []
    for engine in (cached, plain):
        turn1 = tokens(run_all(engine, {"t1": (SHARED, greedy(16))})["t1"])
        turn2 = run_all(engine, {"t2": (SHARED + turn1 + [3, 4, 5], greedy(16))})["t2"]
        answers.append((turn1, tokens(turn2), turn2[-1].num_cached_tokens))
    assert answers[0][:2] == answers[1][:2]
    # 37 + 16 tokens: 13 full blocks, 12 or more taken; an EAGLE sequence's claim ends where the head's rows did
    assert answers[0][2] >= (36 if method == "eagle-chain" else 48) and answers[1][2] == 0, answers[0][2]


@pytest.mark.parametrize("method", ["none", "draft-chain", "ngram", "eagle-chain"])
def test_a_seeded_sample_is_the_same_from_the_cache(eagle_models, method) -> None:
    params = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, seed=21, ignore_eos=True)
    outs = [rounds(engine_for(eagle_models, method, prefix_caching=flag), params) for flag in (True, False)]
    assert outs[0] == outs[1]


@pytest.mark.parametrize("method", ["none", "draft-chain", "eagle-chain"])
def test_kv_pressure_evicts_cached_blocks_and_preempts_without_changing_a_token(eagle_models, uncached, method) -> None:
    """A KV budget of 26 blocks: the five requests cannot all hold their 10-17 blocks, so cached free blocks are
    allocated anew, sequences are preempted and readmitted (taking back what is still cached)."""
    probe = engine_for(eagle_models, method)
    mb_per_block = probe.cfg.kv_cache_mb / probe.block_manager.num_blocks
    tight = engine_for(eagle_models, method, kv_cache_mb=mb_per_block * 26.5)
    assert tight.block_manager.num_blocks == 26
    preemptions: list[float] = []
    assert rounds(tight, preemptions=preemptions) == uncached
    assert sum(preemptions) > 0  # it was short of KV
    check_blocks(tight)
    assert tight.block_manager.num_free_blocks == tight.block_manager.num_blocks
    seeded = SamplingParams(max_tokens=20, temperature=0.9, seed=5, ignore_eos=True)  # readmitted: draws alike
    loose = engine_for(eagle_models, method, prefix_caching=False, kv_cache_mb=mb_per_block * 26.5)
    assert rounds(tight, seeded) == rounds(loose, seeded)


def test_a_request_for_its_prompt_logprobs_computes_every_row(eagle_models) -> None:
    engine = engine_for(eagle_models, "none")
    run_all(engine, {"warm": (SHARED, greedy())})
    asked = SamplingParams(max_tokens=4, temperature=0.0, prompt_logprobs=1)
    out = run_all(engine, {"p": (SHARED + [9], asked)})["p"]
    plain = run_all(engine_for(eagle_models, "none", prefix_caching=False), {"p": (SHARED + [9], asked)})["p"]
    assert out[0].num_cached_tokens == 0 and out[0].prompt_logprobs == plain[0].prompt_logprobs
    assert len(out[0].prompt_logprobs or []) == len(SHARED) + 1


@pytest.mark.parametrize(("method", "num_cached"), [("none", 36), ("draft-chain", 36), ("eagle-chain", 32)])
def test_a_head_row_that_read_another_next_token_is_not_taken(eagle_models, method, num_cached) -> None:
    """Two prompts alike for 9 blocks, unlike from the 37th token: the target's and the draft's rows of those
    blocks serve both; an EAGLE head's row of the 36th position read the first prompt's 37th token, so the
    second claims one block less and computes it."""
    engine = engine_for(eagle_models, method)
    first, second = SHARED[:36] + [1, 2, 3], SHARED[:36] + [4, 5, 6]
    run_all(engine, {"a": (first, greedy())})
    out = run_all(engine, {"b": (second, greedy())})["b"]
    plain = run_all(engine_for(eagle_models, method, prefix_caching=False), {"b": (second, greedy())})["b"]
    assert out[-1].num_cached_tokens == num_cached and tokens(out) == tokens(plain)


def test_an_eagle_sequence_claims_blocks_whose_features_are_kept_and_its_head_rows_are_as_without_the_cache(
    eagle_models,
) -> None:
    """A prompt that ended in its prefill step (one token) registered its blocks without head rows, but with the
    target's features (feature_store.py): the next EAGLE sequence claims them all, and its head computes their rows
    from the stored features: after its first step the head's cache holds, for those 36 positions, what an engine
    without the cache computed (a head whose rows read the features: random_head), and it answers the same."""

    def engine(prefix_caching: bool) -> Engine:
        return spec_engine(eagle_models, eagle="random_head", speculative_method="eagle", prefix_caching=prefix_caching)

    def run_b(e: Engine) -> tuple[tuple[torch.Tensor, torch.Tensor], list[StepOutput]]:
        """The head's K and V of b's first 9 blocks after its first step, and b's outputs."""
        e.add_request("b", SHARED + [1], greedy())
        outs = e.step()
        blocks = torch.tensor(e.sequences["b"].block_table[:9])
        k, v = e.speculator.eagle.runner.kv_cache
        rows = k.index_select(0, blocks), v.index_select(0, blocks)
        while e.num_unfinished():
            outs += e.step()
        return rows, outs

    cached, uncached = engine(True), engine(False)
    run_all(cached, {"warm": (SHARED, SamplingParams(max_tokens=1, temperature=0.0))})
    cache = cached.block_manager.cache
    assert cache is not None and len(cache.key_of) == 9
    assert all(FEATURES in marks and "eagle" not in marks for marks in cache.proposers_of.values())
    (rows, out), (expected_rows, plain) = run_b(cached), run_b(uncached)
    for got, expected in zip(rows, expected_rows, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-12)
    assert out[-1].num_cached_tokens == 36 and plain[-1].num_cached_tokens == 0 and tokens(out) == tokens(plain)
    drafted = ("num_draft_tokens", "num_accepted_tokens")  # the random head's drafts, rejected alike
    assert [out[-1].metrics[k] for k in drafted] == [plain[-1].metrics[k] for k in drafted]


def test_an_eagle_sequence_s_own_copy_with_head_rows_takes_over_the_key(eagle_models) -> None:
    """A prompt decoded without speculation registered its blocks with neither head rows nor features: the next
    EAGLE sequence claims none of them and computes its own, with head rows, which then take over their keys, so
    the one after claims them all."""
    engine = engine_for(eagle_models, "eagle-chain")
    run_all(engine, {"warm": (SHARED, SamplingParams(max_tokens=1, temperature=0.0, speculative="none"))})
    second = run_all(engine, {"b": (SHARED + [1], greedy())})["b"]
    third = run_all(engine, {"c": (SHARED + [2], greedy())})["c"]
    assert (second[-1].num_cached_tokens, third[-1].num_cached_tokens) == (0, 36)
    plain = engine_for(eagle_models, "eagle-chain", prefix_caching=False)
    assert tokens(third) == tokens(run_all(plain, {"c": (SHARED + [2], greedy())})["c"])


def test_only_requests_with_the_same_cache_salt_share_blocks(eagle_models) -> None:
    """vLLM's cache_salt: it seeds the first block's key, so a salted request neither takes an unsalted one's
    blocks nor another salt's, and takes its own salt's; the answers are the same either way."""
    engine = engine_for(eagle_models, "none")

    def cached(rid: str, salt: str | None) -> tuple[int, list[int]]:
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, cache_salt=salt)
        out = run_all(engine, {rid: (SHARED + [int(rid[-1])], params)})[rid]
        return out[-1].num_cached_tokens, tokens(out)

    runs = [cached("a1", None), cached("b2", "tenant-a"), cached("c3", "tenant-b"), cached("d4", "tenant-a"),
            cached("e5", None)]  # fmt: skip
    assert [num for num, _ in runs] == [0, 0, 0, 36, 36]
    with pytest.raises(InvalidRequestError) as refused:
        engine.add_request("bad", SHARED, SamplingParams(cache_salt=""))
    assert refused.value.field == "cache_salt"
