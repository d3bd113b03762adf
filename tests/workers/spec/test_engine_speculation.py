"""Speculative decoding inside the engine, on tiny models in float64: exactness, stops, fallback, metrics."""

from pathlib import Path

import pytest
import torch

import workers.engine.speculator as speculator_module
from shared.speculation import SpeculativeMethod
from tests.workers.engine_runs import (
    draft_like_a_cpu,
    greedy,
    pin_costs,
    run_all,
    spec_engine,
    target_like_a_cpu,
    tokens,
)
from workers.engine.model_runner import ForwardItem
from workers.engine.sampling_params import SamplingParams
from workers.spec.goodput_guard import GoodputGuard, guard_key
from workers.spec.pass_costs import PassTiming
from workers.spec.replan import PROBE_MAX_SEQS

NUM_PROMPTS = 52


def make_prompts() -> list[list[int]]:
    """Random prompts, and repetitive ones that give the n-gram proposer matches."""
    gen = torch.Generator().manual_seed(5)
    prompts = [
        torch.randint(1, 512, (2 + (7 * i) % 40,), generator=gen).tolist() for i in range(NUM_PROMPTS - 12)
    ]
    for i in range(12):
        motif = torch.randint(1, 512, (2 + i % 4,), generator=gen).tolist()
        prompts.append(motif * (3 + i % 5))
    return prompts


@pytest.fixture(scope="module")
def plain_reference(spec_models: dict[str, Path]) -> dict[str, list[int]]:
    engine = spec_engine(spec_models, draft=None, speculative_method="none")
    outs = run_all(engine, {str(i): (p, greedy(24 + i % 9)) for i, p in enumerate(make_prompts())})
    return {rid: tokens(o) for rid, o in outs.items()}


SPEC_CONFIGS = {
    "ngram": dict(speculative_method="ngram"),
    "draft-chain": dict(speculative_method="draft"),
    "draft-chain-fixed-k": dict(speculative_method="draft", is_adaptive=False),
    "draft-tree": dict(speculative_method="draft", tree_size=6, tree_branching=2),
}


@pytest.mark.parametrize("name", SPEC_CONFIGS)
def test_greedy_speculation_equals_plain_decoding_in_a_batch(spec_models, plain_reference, name) -> None:
    engine = spec_engine(spec_models, **SPEC_CONFIGS[name])
    outs = run_all(engine, {str(i): (p, greedy(24 + i % 9)) for i, p in enumerate(make_prompts())})
    assert {rid: tokens(o) for rid, o in outs.items()} == plain_reference
    assert engine.speculator.stats.counts.num_accepted > 0  # speculation really happened and was accepted


@pytest.mark.parametrize("name", SPEC_CONFIGS)
def test_greedy_speculation_equals_plain_decoding_alone(spec_models, plain_reference, name) -> None:
    engine = spec_engine(spec_models, **SPEC_CONFIGS[name])
    for i, p in enumerate(make_prompts()[::6]):
        rid = str(i * 6)
        assert tokens(run_all(engine, {rid: (p, greedy(24 + (i * 6) % 9))})[rid]) == plain_reference[rid]


def test_mixed_batch_some_speculate_some_do_not(spec_models, plain_reference) -> None:
    engine = spec_engine(spec_models)
    choices = [None, "none", "ngram", "draft"]
    requests = {
        str(i): (p, greedy(24 + i % 9, speculative=choices[i % 4])) for i, p in enumerate(make_prompts())
    }
    outs = run_all(engine, requests)
    assert {rid: tokens(o) for rid, o in outs.items()} == plain_reference
    for rid, o in outs.items():
        has_spec = requests[rid][1].speculative != "none"
        assert ("acceptance_rate" in o[-1].metrics) == has_spec


def test_stops_inside_an_accepted_run_emit_nothing_past_them(spec_models, plain_reference) -> None:
    """A stop token, a stop string or max_tokens landing mid-run cuts the output exactly there."""
    engine = spec_engine(spec_models, draft="close_draft", is_adaptive=False, num_speculative_tokens=6)
    text_engine = spec_engine(spec_models, draft=None, speculative_method="none")
    for i, p in enumerate(make_prompts()[:20]):
        ref = plain_reference[str(i)]
        stop_token = ref[7]
        out = tokens(run_all(engine, {"t": (p, greedy(40, stop_token_ids=[stop_token]))})["t"])
        assert out == ref[: ref.index(stop_token) + 1]
        assert tokens(run_all(engine, {"m": (p, greedy(5))})["m"]) == ref[:5]
        full_text = "".join(o.new_text for o in run_all(text_engine, {"x": (p, greedy(24 + i % 9))})["x"])
        stop = full_text[12:15]
        if not stop or "\ufffd" in stop:
            continue
        spec = run_all(engine, {"s": (p, greedy(24 + i % 9, stop=[stop]))})["s"]
        plain = run_all(text_engine, {"s": (p, greedy(24 + i % 9, stop=[stop]))})["s"]
        assert (
            "".join(o.new_text for o in spec)
            == "".join(o.new_text for o in plain)
            == full_text[: full_text.index(stop)]
        )
        assert tokens(spec) == tokens(plain)


def test_eos_inside_an_accepted_run_stops_there(spec_models, plain_reference) -> None:
    engine = spec_engine(spec_models, is_adaptive=False, num_speculative_tokens=6)
    p, ref = make_prompts()[3], plain_reference["3"]
    engine.eos_token_ids = frozenset({ref[9]})
    out = run_all(engine, {"e": (p, SamplingParams(max_tokens=40, temperature=0.0))})["e"]
    assert out[-1].finish_reason == "stop" and tokens(out) == ref[: ref.index(ref[9]) + 1]


@pytest.mark.parametrize("tree_size", [0, 5])
def test_seeded_sampling_with_speculation_is_reproducible(spec_models, tree_size) -> None:
    params = SamplingParams(max_tokens=30, temperature=0.8, top_p=0.95, seed=77, ignore_eos=True)
    runs = []
    for _ in range(2):
        engine = spec_engine(spec_models, tree_size=tree_size)
        runs.append(tokens(run_all(engine, {"s": (make_prompts()[4], params)})["s"]))
    assert runs[0] == runs[1] and len(runs[0]) == 30


def test_poisoned_draft_falls_back_without_losing_jobs(spec_models, plain_reference) -> None:
    engine = spec_engine(spec_models, draft="poisoned_draft")
    outs = run_all(engine, {str(i): (p, greedy(24 + i % 9)) for i, p in enumerate(make_prompts()[:8])})
    assert {rid: tokens(o) for rid, o in outs.items()} == {str(i): plain_reference[str(i)] for i in range(8)}
    assert engine.speculator.stats.num_fallbacks == 8
    assert all(o[-1].metrics["spec_fallback"] == 1.0 for o in outs.values())


def test_useless_draft_falls_back_after_patience(spec_models, plain_reference) -> None:
    engine = spec_engine(
        spec_models, draft="random_draft", spec_fallback_patience_steps=4, spec_fallback_acceptance=0.3
    )
    outs = run_all(engine, {"0": (make_prompts()[0], greedy(24))})
    assert tokens(outs["0"]) == plain_reference["0"]
    assert outs["0"][-1].metrics["spec_fallback"] == 1.0
    assert engine.speculator.stats.num_fallbacks == 1


def test_draft_equal_to_target_accepts_everything(spec_models) -> None:
    models = dict(spec_models, same=spec_models["target"])
    engine = spec_engine(models, draft="same", is_adaptive=False, num_speculative_tokens=4)
    out = run_all(engine, {"a": (make_prompts()[1], greedy(21))})["a"]
    metrics = out[-1].metrics
    assert metrics["acceptance_rate"] == 1.0 and metrics["mean_accepted_tokens"] == 5.0
    assert metrics["draft_rejection_rate"] == 0.0
    assert [len(o.new_token_ids) for o in out] == [
        1,
        5,
        5,
        5,
        5,
    ]  # prefill's token, then 4 accepted + 1 bonus


def test_a_compute_bound_target_switches_speculation_off_for_a_large_batch(spec_models) -> None:
    """Where every target token costs as much as a pass's fixed part, drafting for 12 sequences cannot pay:
    the length policy chooses plain decoding for the batch, and still speculates for a lone sequence."""
    engine = spec_engine(spec_models, costs=(lambda n: 2e-3 + 1e-3 * n, lambda n: 0.1e-3 + 0.05e-3 * n))
    run_all(engine, {str(i): (p, greedy(10)) for i, p in enumerate(make_prompts()[:12])})
    assert engine.speculator.stats.counts.num_steps == 0
    run_all(engine, {"solo": (make_prompts()[0], greedy(10))})
    assert engine.speculator.stats.counts.num_steps > 0


def test_engine_speculation_metrics_per_position(spec_models) -> None:
    engine = spec_engine(spec_models, is_adaptive=False, num_speculative_tokens=3)
    run_all(engine, {str(i): (p, greedy(20)) for i, p in enumerate(make_prompts()[:6])})
    counts = engine.speculator.stats.counts
    rates = counts.per_position_acceptance()
    assert len(rates) == 3 and rates[0] >= rates[1] >= rates[2]
    # a path is judged up to its first rejection: a step rejected one token, or none where it accepted its whole
    # path (3 tokens, or fewer near max_tokens)
    num_full = sum(n for accepted, n in engine.speculator.stats.accepted_length_histogram.items() if accepted == 3)
    assert 0 < counts.num_rejected <= counts.num_steps - num_full
    assert counts.rejection_rate == counts.num_rejected / (counts.num_accepted + counts.num_rejected)
    assert counts.rejection_rate < 1 - counts.acceptance_rate  # untested tokens after a rejection count in neither
    assert sum(engine.speculator.stats.accepted_length_histogram.values()) == counts.num_steps
    assert engine.speculator.stats.draft_time_s > 0 and engine.speculator.stats.verify_time_s > 0


def test_a_tree_cut_by_the_batch_budget_becomes_a_chain(spec_models) -> None:
    models = dict(spec_models, same=spec_models["target"])
    engine = spec_engine(
        models, draft="same", tree_size=6, tree_branching=2, is_adaptive=False, max_num_batched_tokens=4
    )  # one sequence: 4 - 1 = 3 spare target tokens, too few for the 6-node tree

    out = run_all(engine, {"a": (make_prompts()[1], greedy(13))})["a"]

    # the 9-token prompt runs in chunks of 4, 4, 1; its last token already decodes, so every step is a chain
    # of 3, all accepted, + bonus; the 13th token is the last: nothing left to draft
    assert [len(o.new_token_ids) for o in out] == [4, 4, 4, 1]
    counts = engine.speculator.stats.counts
    assert counts.num_steps == 3 and counts.num_drafted == 9


def test_a_full_size_tree_is_proposed_when_the_budget_allows(spec_models) -> None:
    models = dict(spec_models, same=spec_models["target"])
    engine = spec_engine(
        models, draft="same", tree_size=6, tree_branching=2, is_adaptive=False, num_speculative_tokens=4
    )

    run_all(engine, {"a": (make_prompts()[1], greedy(13))})

    counts = engine.speculator.stats.counts
    assert counts.num_steps == 3
    assert counts.num_drafted == 6 + 6 + 4  # two 6-node trees; then 5 tokens to go, too few for a tree ...
    assert counts.drafted_per_position[2:] == [1, 1]  # ... so a chain of k_max = 4
    assert counts.num_rejected == 0  # a perfect draft's accepted path always ends at a leaf: nothing rejected


def test_the_engine_measures_pass_costs_at_start_and_keeps_them_current(spec_models) -> None:
    engine = spec_engine(spec_models, costs=None)  # the costs this host measures
    target, draft = engine.speculator.target_costs, engine.speculator.proposer_costs["draft"]
    assert target.is_measured and draft.is_measured  # probed before the first request
    assert 1 in target.snapshot() and 32 in target.snapshot()
    before = list(target.seconds)
    run_all(engine, {str(i): (p, greedy(12)) for i, p in enumerate(make_prompts()[:4])})
    # every pass the engine ran moved the table's measured points (its lower envelope, snapshot(), may hide
    # that where a bigger pass measured cheaper)
    assert target.seconds != before
    assert sum(n for n, _ in engine.speculator.chosen_by_batch.values()) > 0  # the policy planned steps
    overhead = engine.speculator.step_overhead  # and every step measured its work outside the passes
    assert overhead.plain_per_seq_s is not None and overhead.plain_per_seq_s > 0  # the prefill steps at least
    assert overhead.speculative_step_s >= 0


def test_a_runner_tells_its_first_pass_of_each_shape_and_the_tables_skip_it(spec_models) -> None:
    """oneDNN sets up its matmuls anew for every new token count (~4 ms a pass on the demo target): a runner
    flags its first pass of a new token count or logits row count, the cost table does not learn from it, and
    a step that ran one feeds neither the step overhead nor the goodput guard."""
    engine = spec_engine(spec_models, costs=None)
    runner, speculator = engine.runner, engine.speculator
    timings: list[PassTiming] = []
    runner.on_pass = lambda timing: (timings.append(timing), speculator.observe_target_pass(timing))
    seven = [ForwardItem([1] * 7, 0, [0, 1], num_logits=7)]  # 7 tokens: no probe ran that shape
    before = list(speculator.target_costs.seconds)
    runner.forward(seven)
    assert [t.is_first_of_shape for t in timings] == [True] and speculator.target_costs.seconds == before
    runner.forward(seven)
    more = next(n for n in range(9, 16) if n not in runner.shapes_run.tokens)  # a token count not run yet
    runner.forward([ForwardItem([1] * more, 0, [0, 1, 2, 3], num_logits=1)])  # a new token count, a logits count run before
    runner.forward([ForwardItem([1] * more, 0, [0, 1, 2, 3], num_logits=7)])  # both counts run before, apart
    assert [t.is_first_of_shape for t in timings] == [True, False, True, False]
    assert speculator.target_costs.seconds != before  # the second pass of the shape was learnt from
    measured: list[str] = []  # what each step fed: the step overhead's and the guard's own observe, recorded
    observe_overhead, observe_guard = speculator.step_overhead.observe, speculator.guard.observe
    speculator.step_overhead.observe = lambda *a: (measured.append("overhead"), observe_overhead(*a))
    speculator.guard.observe = lambda *a: (measured.append("guard"), observe_guard(*a))
    for is_first in (True, False):
        speculator.begin_step()
        speculator._guard_key = guard_key(4, False, ("draft",))  # as a planned step of 4 decodes
        speculator.observe_target_pass(PassTiming(9, 0.005, is_first_of_shape=is_first))
        speculator.end_step(0.006, 4, 0, 4)
    assert measured == ["overhead", "guard"]  # the second step only


def test_a_batch_whose_plans_draft_nothing_is_planned_less_often_and_decodes_the_same(spec_models, plain_reference) -> None:
    """A draft as dear as the target: every plan drafts nothing, so after a few empty plans the engine plans that
    batch every 2, 4, 8, 16 steps (replan.py); the skipped steps decode plainly and the tokens are the plain ones."""
    engine = spec_engine(spec_models, costs=(lambda n: 1e-3, lambda n: 1e-3))  # a draft pass costs a target pass
    planned = []
    choose = speculator_module.choose_lengths

    def counting_choose(*args, **kwargs):
        planned.append(1)
        return choose(*args, **kwargs)

    speculator_module.choose_lengths = counting_choose
    try:
        out = run_all(engine, {"0": (make_prompts()[0], greedy(24))})
    finally:
        speculator_module.choose_lengths = choose
    assert tokens(out["0"]) == plain_reference["0"]  # 24 tokens: a prefill step, then 23 decode steps
    stats = engine.speculator.stats
    assert stats.counts.num_drafted == 0
    assert len(planned) <= 4 + 3  # the streak of 4, then plans 2, 4 and 8 steps apart
    assert stats.num_unplanned_steps >= 23 - len(planned) - 1  # the rest were not planned (the last has no room)


def test_a_batch_whose_plans_stay_empty_drafts_a_probe_now_and_then_and_decodes_the_same(spec_models) -> None:
    """Costs that keep every plan empty (pinned: the probe's passes cannot change them): the batch is planned
    less often (4 plans, then 2, 4, 8, 16 steps apart), and its 8th empty plan, at step 34, drafts one chain
    anyway (replan.PROBE_EVERY): where real costs or acceptance had been misread, that chain's passes and
    verdicts would correct them. The goodput guard, which judges the policy's plans, is not told of it. The
    tokens are the plain ones."""
    prompt, params = make_prompts()[0], greedy(64)
    plain = tokens(run_all(spec_engine(spec_models, draft=None, speculative_method="none"), {"0": (prompt, params)})["0"])
    engine = spec_engine(spec_models, costs=(lambda n: 1e-3, lambda n: 1e-3))  # a draft pass costs a target pass
    judged: list[bool] = []  # what the guard was told of each planned step: did it speculate
    engine.speculator.guard.observe = lambda key, is_speculative, *rest: judged.append(is_speculative)
    num_steps_drafted = 0
    engine.add_request("0", prompt, params)
    outs = []
    while engine.num_unfinished():
        num_drafted = engine.speculator.stats.counts.num_drafted
        outs.extend(engine.step())
        num_steps_drafted += engine.speculator.stats.counts.num_drafted > num_drafted
    assert tokens(outs) == plain
    assert num_steps_drafted == 1  # one probe in 63 decode steps
    assert judged and not any(judged)  # the planned steps that drafted nothing, not the probe
    assert 0 < engine.speculator.stats.counts.num_drafted <= engine.cfg.num_speculative_tokens


def test_a_probe_of_a_large_batch_drafts_for_a_few_sequences_and_decodes_the_same(spec_models) -> None:
    """A batch of 6 whose plans stay empty: its probe drafts for PROBE_MAX_SEQS of them, not all (each drafting
    sequence pays its proposer's backlog: at 16 demo sequences a probe of all of them took 8-17 plain steps);
    the tokens are the plain ones."""
    engine = spec_engine(spec_models, costs=(lambda n: 1e-3, lambda n: 1e-3))  # a draft pass costs a target pass
    requests = {str(i): (make_prompts()[i], greedy(64)) for i in range(6)}
    drafting_per_step: list[int] = []
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    outs = []
    while engine.num_unfinished():
        num_steps = engine.speculator.stats.counts.num_steps  # sequence-steps that verified drafts
        outs.extend(engine.step())
        drafting_per_step.append(engine.speculator.stats.counts.num_steps - num_steps)
    by_request: dict[str, list] = {}
    for out in outs:
        by_request.setdefault(out.request_id, []).append(out)
    reference = spec_engine(spec_models, draft=None, speculative_method="none")
    plain = run_all(reference, requests)
    assert {rid: tokens(o) for rid, o in by_request.items()} == {rid: tokens(o) for rid, o in plain.items()}
    probes = [n for n in drafting_per_step if n]
    assert probes and all(n == PROBE_MAX_SEQS for n in probes)  # each probe: 4 of the 6


def test_a_quiet_batch_takes_prompts_in_only_once_speculation_pays_again(spec_models, plain_reference) -> None:
    """While a batch size's plans draft nothing (replan.is_quiet), the draft model does not take new prompts in
    (Speculator.prefill); once its costs make speculation pay, the next plan drafts, the prompt is taken in,
    the sequence drafts, and its tokens are the plain ones throughout."""
    engine = spec_engine(spec_models, costs=(lambda n: 1e-3, lambda n: 1e-3))  # a draft pass costs a target pass
    run_all(engine, {"0": (make_prompts()[0], greedy(24))})  # 23 empty plans: a batch of one is quiet
    engine.add_request("1", make_prompts()[1], greedy(24 + 1))
    outs = list(engine.step())  # the prefill
    seq = engine.sequences["1"]
    assert seq.spec is not None and seq.spec.draft_num_computed == 0  # not taken in
    assert engine.speculator.stats.counts.num_drafted == 0
    pin_costs(engine, target_like_a_cpu, draft_like_a_cpu)  # now a draft pass is cheap: speculation pays
    taken_in_at = None
    while engine.num_unfinished():
        outs.extend(engine.step())
        if taken_in_at is None and "1" in engine.sequences and seq.spec.draft_num_computed > 0:
            taken_in_at = seq.num_output_tokens
    assert tokens(outs) == plain_reference["1"]
    assert taken_in_at is not None and engine.speculator.stats.counts.num_drafted > 0


def veto(engine, num_decodes: int, method: str = "draft") -> None:
    """Tell the engine's guard that speculative decode steps of this batch size delivered a tenth of what plain
    ones did (the guard's own observe: spec_engine stops the steps from feeding it)."""
    key = guard_key(num_decodes, False, (method,))
    for _ in range(engine.speculator.guard.min_samples):
        GoodputGuard.observe(engine.speculator.guard, key, True, 16, 1.0)
        GoodputGuard.observe(engine.speculator.guard, key, False, 16, 0.1)


def test_a_batch_where_speculation_delivered_less_decodes_plainly(spec_models, plain_reference) -> None:
    """The guard's veto: the length policy, which would draft here, is not asked; no draft is proposed, the
    tokens are the same, and every vetoed step is counted. A batch of another size still speculates."""
    engine = spec_engine(spec_models)
    veto(engine, num_decodes=8)
    outs = run_all(engine, {str(i): (p, greedy(24)) for i, p in enumerate(make_prompts()[:8])})
    assert {rid: tokens(o) for rid, o in outs.items()} == {str(i): plain_reference[str(i)][:24] for i in range(8)}
    assert engine.speculator.stats.counts.num_steps == 0
    assert engine.speculator.stats.num_vetoed_steps == 23  # every decode step after the prefill's first token
    run_all(engine, {"solo": (make_prompts()[0], greedy(10))})
    assert engine.speculator.stats.counts.num_steps > 0


def test_a_vetoed_batch_keeps_a_seeded_request_s_own_lengths(spec_models) -> None:
    """A seeded sampling request drafts its nominal k whatever the guard says, so its sample does not depend on
    what this host measured."""
    params = SamplingParams(max_tokens=30, temperature=0.8, top_p=0.95, seed=77, ignore_eos=True)
    runs = []
    for is_vetoed in (False, True):
        engine = spec_engine(spec_models)
        if is_vetoed:
            veto(engine, num_decodes=1)
        runs.append(tokens(run_all(engine, {"s": (make_prompts()[4], params)})["s"]))
        assert engine.speculator.stats.counts.num_steps > 0
    assert engine.speculator.stats.num_vetoed_steps > 0
    assert runs[0] == runs[1]


def test_the_engine_feeds_the_guard_each_planned_step(spec_models) -> None:
    engine = spec_engine(spec_models)
    guard = engine.speculator.guard
    del guard.observe  # spec_engine froze it: the engine's own measurements this time
    run_all(engine, {str(i): (p, greedy(12)) for i, p in enumerate(make_prompts()[:4])})
    seen = guard._keys[guard_key(4, False, ("draft",))]
    assert seen.speculative.num_samples + seen.plain.num_samples > 0
    assert seen.speculative.seconds > 0 and seen.speculative.num_tokens >= 4  # at least one token a sequence


def test_new_sequences_start_from_the_acceptance_their_proposer_achieved(spec_models) -> None:
    """A draft that the target always accepts: after one request, the pooled acceptance is near 1, and the
    next request's first estimate starts there, not at the constant prior; a seeded one keeps the constant."""
    models = dict(spec_models, same=spec_models["target"])
    engine = spec_engine(models, draft="same")
    run_all(engine, {"a": (make_prompts()[1], greedy(40))})
    pool = engine.speculator.pooled_acceptance[SpeculativeMethod.DRAFT]
    assert pool.acceptance > 0.9
    engine.add_request("b", make_prompts()[2], greedy(8))
    engine.add_request("s", make_prompts()[3], SamplingParams(max_tokens=8, temperature=0.8, seed=3))
    fresh, seeded = engine.sequences["b"].spec, engine.sequences["s"].spec
    assert fresh is not None and fresh.controller.acceptance == pytest.approx(pool.acceptance)
    assert seeded is not None and seeded.controller.pool is None
    assert seeded.controller.acceptance == pytest.approx(engine.speculator.adaptive.initial_acceptance)
