"""Priority scheduling without a model: who is preempted for whom, the per-sequence bound, reservations, and
what the worker reads (num_preemptible_for)."""

from workers.engine.block_manager import BlockManager
from workers.engine.priority import PriorityPolicy
from workers.engine.sampling_params import SamplingParams
from workers.engine.scheduler import Scheduler
from workers.engine.sequence import Sequence, SequenceStatus

INTERACTIVE, DEFAULT, BATCH = 0, 1, 2


def new_seq(request_id: str, num_prompt_tokens: int, priority: int) -> Sequence:
    prompt = list(range(1, num_prompt_tokens + 1))
    # the scheduler never reads the detokenizer
    return Sequence(request_id, prompt, num_prompt_tokens, SamplingParams(), detokenizer=None, generator=None,  # type: ignore[arg-type]
                    priority=priority)  # fmt: skip


def run_plan(scheduler: Scheduler) -> list[str]:
    """What the engine does with a plan, without a model -> the ids scheduled."""
    plan = scheduler.schedule()
    for s in plan.scheduled:
        s.seq.num_computed_tokens += s.num_new_tokens
        if s.is_sampling:
            s.seq.token_ids.append(7)
    return [s.request_id for s in plan.scheduled]


def scheduler_with(
    num_blocks: int, max_num_seqs: int, limit: int = 4, reserved: dict[int, float] | None = None
) -> Scheduler:
    blocks = BlockManager(num_blocks=num_blocks, block_size=4)
    policy = PriorityPolicy(max_num_seqs, num_blocks, limit, reserved)
    return Scheduler(blocks, max_num_seqs=max_num_seqs, max_num_batched_tokens=64, policy=policy)


def test_an_urgent_request_preempts_the_least_urgent_newest_running_one_for_a_slot() -> None:
    scheduler = scheduler_with(num_blocks=32, max_num_seqs=3)
    old_batch, default, new_batch = (
        new_seq("old", 4, BATCH),
        new_seq("def", 4, DEFAULT),
        new_seq("new", 4, BATCH),
    )
    for seq in (old_batch, default, new_batch):
        scheduler.add(seq)
    run_plan(scheduler)
    assert [s.request_id for s in scheduler.running] == [
        "def",
        "old",
        "new",
    ]  # sorted by priority, FCFS within
    scheduler.add(new_seq("urgent", 4, INTERACTIVE))
    assert scheduler.num_preemptible_for(INTERACTIVE) == 0  # one as urgent already waits
    plan = scheduler.schedule()
    assert plan.preempted == [new_batch] and new_batch.num_preemptions == 1
    # short of a slot only: it is parked with its KV, and resumes where it stopped
    assert new_batch.status is SequenceStatus.WAITING and new_batch.num_computed_tokens == 4
    assert len(new_batch.block_table) == 1
    assert [s.request_id for s in plan.scheduled] == ["urgent"]  # its first chunk runs without less urgent ones
    assert [s.request_id for s in scheduler.waiting] == ["new"]
    urgent = plan.scheduled[0].seq
    urgent.num_computed_tokens, urgent.token_ids = 4, [*urgent.token_ids, 7]  # its prefill ran
    assert [s.request_id for s in scheduler.schedule().scheduled] == ["urgent", "def", "old"]  # then together
    scheduler.finish(scheduler.running[0], "stop")
    (resumed,) = [s for s in scheduler.schedule().scheduled if s.request_id == "new"]
    assert (resumed.start_pos, resumed.num_new_tokens, resumed.is_sampling) == (4, 1, True)  # no recompute


def test_kv_pressure_frees_parked_kv_before_it_preempts_a_running_sequence() -> None:
    scheduler = scheduler_with(num_blocks=7, max_num_seqs=2)
    batch = new_seq("batch", 4, BATCH)
    scheduler.add(batch)
    run_plan(scheduler)
    scheduler.add(new_seq("default", 4, DEFAULT))
    for _ in range(2):
        run_plan(scheduler)
    scheduler.add(new_seq("urgent", 8, INTERACTIVE))
    plan = scheduler.schedule()
    assert plan.preempted == [batch] and len(batch.block_table) == 2  # parked with its 2 blocks
    for _ in range(8):  # the running two grow until the free blocks run out: the parked KV goes, nobody runs less
        for s in plan.scheduled:
            s.seq.num_computed_tokens += s.num_new_tokens
            s.seq.token_ids.append(7)
        plan = scheduler.schedule()
        assert plan.preempted == [] and [s.request_id for s in plan.scheduled] == ["urgent", "default"]
        if not batch.block_table:
            break
    assert batch.block_table == [] and batch.num_computed_tokens == 0 and batch.num_preemptions == 1


def test_never_preempted_for_an_equal_or_less_urgent_request() -> None:
    scheduler = scheduler_with(num_blocks=32, max_num_seqs=2)
    for name in ("a", "b"):
        scheduler.add(new_seq(name, 4, DEFAULT))
    run_plan(scheduler)
    scheduler.add(new_seq("same", 4, DEFAULT))
    scheduler.add(new_seq("batch", 4, BATCH))
    assert scheduler.num_preemptible_for(DEFAULT) == 0 and scheduler.num_preemptible_for(BATCH) == 0
    for _ in range(3):
        plan = scheduler.schedule()
        assert plan.preempted == [] and [s.request_id for s in plan.scheduled] == ["a", "b"]
    assert [s.request_id for s in scheduler.waiting] == ["same", "batch"]


def test_an_urgent_request_preempts_for_kv_room_only_when_that_makes_room() -> None:
    scheduler = scheduler_with(num_blocks=6, max_num_seqs=8)
    batch = new_seq("batch", 16, BATCH)  # 4 blocks, then 5 with its first decode
    scheduler.add(batch)
    run_plan(scheduler)
    too_big = new_seq("huge", 40, INTERACTIVE)  # 10 blocks + 1: more than the whole cache
    scheduler.add(too_big)
    plan = scheduler.schedule()
    assert plan.preempted == [] and batch.status is SequenceStatus.RUNNING
    scheduler.finish(too_big, "abort")
    urgent = new_seq("urgent", 8, INTERACTIVE)  # 2 blocks + 1 free for its decode: only 1 is free
    scheduler.add(urgent)
    plan = scheduler.schedule()
    assert plan.preempted == [batch] and [s.request_id for s in plan.scheduled] == ["urgent"]
    assert batch.block_table == [] and batch.num_computed_tokens == 0  # short of KV: its KV is freed


def test_a_sequence_is_preempted_for_priority_at_most_limit_times() -> None:
    scheduler = scheduler_with(num_blocks=32, max_num_seqs=1, limit=2)
    batch = new_seq("batch", 4, BATCH)
    scheduler.add(batch)
    run_plan(scheduler)
    for i in range(3):
        assert scheduler.num_preemptible_for(INTERACTIVE) == (1 if i < 2 else 0)
        urgent = new_seq(f"urgent{i}", 4, INTERACTIVE)
        scheduler.add(urgent)
        scheduled = run_plan(scheduler)
        if i < 2:
            assert scheduled == [urgent.request_id] and batch.num_preemptions == i + 1
            scheduler.finish(urgent, "stop")
            assert run_plan(scheduler) == ["batch"]  # readmitted: its prompt and output recomputed
    assert scheduled == ["batch"] and batch.num_preemptions == 2  # at the limit: the third one waits
    assert [s.request_id for s in scheduler.waiting] == ["urgent2"]


def test_recompute_stops_short_of_the_last_token_which_runs_as_a_decode() -> None:
    scheduler = scheduler_with(num_blocks=3, max_num_seqs=8)  # the urgent request needs the batch one's KV
    batch = new_seq("batch", 6, BATCH)
    scheduler.add(batch)
    run_plan(scheduler)
    run_plan(scheduler)  # 6 prompt tokens + 2 output tokens, 7 computed
    scheduler.add(urgent := new_seq("urgent", 4, INTERACTIVE))
    run_plan(scheduler)
    scheduler.finish(urgent, "stop")
    plan = scheduler.schedule()
    (entry,) = plan.scheduled
    assert (entry.start_pos, entry.num_new_tokens, entry.is_sampling) == (0, 7, False)
    entry.seq.num_computed_tokens += entry.num_new_tokens
    (entry,) = scheduler.schedule().scheduled
    assert (entry.start_pos, entry.num_new_tokens, entry.is_sampling) == (7, 1, True)


def test_reserved_capacity_is_borrowed_while_preemptible_and_kept_from_sequences_at_their_limit() -> None:
    scheduler = scheduler_with(num_blocks=64, max_num_seqs=4, limit=1, reserved={INTERACTIVE: 0.25})
    batch = [new_seq(f"b{i}", 4, BATCH) for i in range(4)]
    for seq in batch:
        scheduler.add(seq)
    run_plan(scheduler)
    assert len(scheduler.running) == 4  # nobody else wants the reserved slot: a batch job borrows it
    scheduler.add(urgent := new_seq("urgent", 4, INTERACTIVE))
    plan = scheduler.schedule()
    assert plan.preempted == [batch[3]]
    scheduler.finish(urgent, "stop")
    for _ in range(3):
        run_plan(scheduler)
    # b3 is at its limit: nothing may preempt it now, so it may not hold the interactive reserve
    assert batch[3].status is SequenceStatus.WAITING and len(scheduler.running) == 3
    scheduler.finish(batch[0], "stop")
    run_plan(scheduler)
    assert batch[3].status is SequenceStatus.RUNNING  # within the batch share again
