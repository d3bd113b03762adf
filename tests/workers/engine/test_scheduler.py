"""The scheduler's typed plan for a mixed batch: a speculating decode, a plain decode and a chunked prefill."""

import dataclasses

import pytest

from workers.engine.block_manager import BlockManager
from workers.engine.sampling_params import SamplingParams
from workers.engine.scheduler import Scheduler
from workers.engine.sequence import Sequence


def new_seq(request_id: str, num_prompt_tokens: int) -> Sequence:
    prompt = list(range(1, num_prompt_tokens + 1))
    # the scheduler never reads the detokenizer
    return Sequence(request_id, prompt, num_prompt_tokens, SamplingParams(), detokenizer=None, generator=None)  # type: ignore[arg-type]


def run_plan(scheduler: Scheduler) -> None:
    """What the engine does with a plan, without a model: computed chunks, one token per sampling entry."""
    for s in scheduler.schedule().scheduled:
        s.seq.num_computed_tokens += s.num_new_tokens
        if s.is_sampling:
            s.seq.token_ids.append(7)


def test_the_plan_of_a_mixed_prefill_decode_and_speculating_batch() -> None:
    blocks = BlockManager(num_blocks=64, block_size=4)
    asked: list[tuple[list[str], int, int]] = []  # the planner's arguments: decodes, base tokens, room left

    def plan_lookahead(decodes: list[Sequence], num_base_tokens: int, max_extra_tokens: int) -> dict[str, int]:
        asked.append(([s.request_id for s in decodes], num_base_tokens, max_extra_tokens))
        return {"spec": 3}

    scheduler = Scheduler(blocks, max_num_seqs=8, max_num_batched_tokens=16, plan_lookahead=plan_lookahead)
    spec, plain, long = new_seq("spec", 5), new_seq("plain", 3), new_seq("long", 40)
    scheduler.add(spec)
    scheduler.add(plain)
    run_plan(scheduler)  # both prompts fit the budget: each samples its first token
    scheduler.add(long)

    plan = scheduler.schedule()
    by_id = {s.request_id: s for s in plan.scheduled}
    assert list(by_id) == ["spec", "plain", "long"]  # running order, the admitted prefill last
    assert (by_id["spec"].start_pos, by_id["spec"].num_new_tokens, by_id["spec"].num_lookahead) == (5, 1, 3)
    assert (by_id["plain"].start_pos, by_id["plain"].num_new_tokens, by_id["plain"].num_lookahead) == (3, 1, 0)
    assert (by_id["long"].start_pos, by_id["long"].num_new_tokens, by_id["long"].num_lookahead) == (0, 11, 0)
    assert by_id["spec"].is_sampling and by_id["plain"].is_sampling
    assert not by_id["long"].is_sampling  # a chunk short of the prompt's end samples nothing
    assert plan.num_batched_tokens == 16 and plan.preempted == []
    assert [s.request_id for s in plan.speculating] == ["spec"]
    for s in plan.scheduled:  # the KV for the chunk and the lookahead is reserved before the plan is handed out
        assert s.block_table is s.seq.block_table
        assert len(s.block_table) * 4 >= s.start_pos + s.num_new_tokens + s.num_lookahead
    assert spec.num_computed_tokens == 5 and long.num_computed_tokens == 0  # scheduling computes nothing
    # asked with the pass it would run: 2 decodes + the waiting prompt's chunk fill the 16 tokens, no room left
    # (the planner's answer is still capped by the budget: the prefill chunk shrinks to make room)
    assert asked[-1] == (["spec", "plain"], 16, 0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.scheduled[0].num_new_tokens = 2  # type: ignore[misc]


def test_preemption_is_in_the_plan() -> None:
    blocks = BlockManager(num_blocks=3, block_size=4)
    scheduler = Scheduler(blocks, max_num_seqs=8, max_num_batched_tokens=64)
    first, second = new_seq("first", 4), new_seq("second", 4)
    scheduler.add(first)
    scheduler.add(second)
    run_plan(scheduler)  # each holds 1 block and now has a 5th token to compute; 1 block is free
    plan = scheduler.schedule()  # first's decode takes the free block; second, the newest, is preempted
    assert [s.request_id for s in plan.scheduled] == ["first"]
    assert plan.preempted == [second] and second.num_computed_tokens == 0
