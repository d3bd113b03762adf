"""Proposers return values and leave the sequences as they were; the engine's applier writes the results."""

import dataclasses
from pathlib import Path

from tests.workers.engine_runs import greedy, spec_engine
from workers.engine.engine import Engine, forward_item
from workers.engine.scheduler_output import SchedulerOutput
from workers.engine.sequence import Sequence
from workers.spec.verify_batch import VerifyEntry

PROMPTS = {"a": [5, 9, 14, 5, 9, 14, 5, 9], "b": [3, 17, 40, 2, 8]}


FIXED_K = {"is_adaptive": False, "num_speculative_tokens": 3}  # every step drafts 3 tokens


def decoding_plan(engine: Engine) -> SchedulerOutput:
    """Prefill both prompts in one step, then schedule the next: both decode, each with lookahead."""
    for request_id, prompt in PROMPTS.items():
        engine.add_request(request_id, prompt, greedy(16))
    engine.step()
    plan = engine.scheduler.schedule()
    assert [s.num_lookahead for s in plan.speculating] == [3, 3]
    return plan


def state_of(seq: Sequence) -> tuple:
    """Everything of a sequence and its speculation state that a step may change."""
    spec = seq.spec
    assert spec is not None
    return (
        list(seq.token_ids), seq.num_computed_tokens, list(seq.block_table), seq.status, seq.first_token_time_s,
        spec.draft_num_computed, dataclasses.astuple(spec.counts), spec.controller.k, spec.controller.acceptance,
        spec.fallback_reason, len(spec.ngram) if spec.ngram is not None else None,
    )


def test_draft_proposals_leave_the_sequences_untouched_until_the_engine_applies_them(
    spec_models: dict[str, Path],
) -> None:
    engine = spec_engine(spec_models, "close_draft", **FIXED_K)
    plan = decoding_plan(engine)
    before = {s.request_id: state_of(s.seq) for s in plan.scheduled}

    proposed = engine.speculator.propose(plan.speculating)
    assert {s.request_id: state_of(s.seq) for s in plan.scheduled} == before
    assert set(proposed.proposals) == {"a", "b"} and not proposed.fallbacks
    for s in plan.speculating:
        proposal = proposed.proposals[s.request_id]
        assert proposal.num_tokens == 3
        assert proposal.draft_num_computed == len(s.seq) + 3 - 1  # the draft cache holds all but the last
        assert s.seq.spec is not None  # the seq still says: only the prompt, taken in at prefill
        assert s.seq.spec.draft_num_computed == s.seq.num_prompt_tokens

    engine.applier.apply_proposals(proposed, engine.sequences)
    for s in plan.speculating:
        assert s.seq.spec is not None
        assert s.seq.spec.draft_num_computed == proposed.proposals[s.request_id].draft_num_computed


def test_the_verifier_returns_verdicts_and_the_engine_applies_them(spec_models: dict[str, Path]) -> None:
    engine = spec_engine(spec_models, "close_draft", **FIXED_K)
    plan = decoding_plan(engine)
    proposed = engine.speculator.propose(plan.speculating)
    engine.applier.apply_proposals(proposed, engine.sequences)
    proposals = proposed.to_verify
    logits = engine.runner.forward([forward_item(s, proposals.get(s.request_id)) for s in plan.scheduled])
    entries = [VerifyEntry(s.seq.params, s.seq.generator, proposals.get(s.request_id)) for s in plan.scheduled]
    before = {s.request_id: state_of(s.seq) for s in plan.scheduled}
    verdicts = engine.speculator.verify(entries, logits)
    assert {s.request_id: state_of(s.seq) for s in plan.scheduled} == before

    s, proposal, verdict = plan.scheduled[0], proposals["a"], verdicts[0]
    old_len = len(s.seq)
    appended, reason = engine.applier.apply_verdict(s, proposal, verdict, now_s=1.0)
    assert appended == verdict.tokens and reason is None
    assert s.seq.token_ids[old_len:] == verdict.tokens
    assert s.seq.num_computed_tokens == s.start_pos + 1 + verdict.num_accepted
    assert s.seq.first_token_time_s is not None
    spec = s.seq.spec
    assert spec is not None and proposal.draft_num_computed is not None
    assert spec.draft_num_computed == min(proposal.draft_num_computed, old_len + verdict.num_accepted)
    assert spec.counts.num_steps == 1 and spec.counts.num_accepted == verdict.num_accepted
    assert engine.speculator.stats.counts.num_steps == 1


def test_a_failing_draft_is_a_fallback_the_engine_applies(spec_models: dict[str, Path]) -> None:
    engine = spec_engine(spec_models, "poisoned_draft", **FIXED_K)
    plan = decoding_plan(engine)
    before = {s.request_id: state_of(s.seq) for s in plan.scheduled}
    proposed = engine.speculator.propose(plan.speculating)
    assert proposed.fallbacks == {"a": "draft_error", "b": "draft_error"} and not proposed.proposals
    assert {s.request_id: state_of(s.seq) for s in plan.scheduled} == before
    assert engine.speculator.stats.num_fallbacks == 0

    engine.applier.apply_proposals(proposed, engine.sequences)
    for s in plan.scheduled:
        assert s.seq.spec is not None and s.seq.spec.fallback_reason == "draft_error" and not s.seq.spec.is_active
    assert engine.speculator.stats.num_fallbacks == 2
