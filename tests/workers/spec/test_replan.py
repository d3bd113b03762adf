"""A batch whose plans keep drafting nothing is planned less often, and planned every step again once one drafts;
every PROBE_EVERY-th of its empty plans in a row is a probe."""

from workers.spec.goodput_guard import guard_key
from workers.spec.replan import (
    EMPTY_STREAK,
    MAX_INTERVAL,
    MAX_PROBE_GAP,
    PROBE_EVERY,
    PROBE_MAX_SEQS,
    Replan,
    probe_picks,
)

KEY = guard_key(16, False, ("draft",))
OTHER = guard_key(1, False, ("draft",))


def planned_steps(replan: Replan, key: tuple, num_steps: int, drafts: bool = False) -> list[int]:
    """The steps (0-based) on which `key` was planned, each plan drafting `drafts`."""
    steps = []
    for step in range(num_steps):
        if replan.is_due(key):
            steps.append(step)
            replan.record(key, is_empty=not drafts)
    return steps


def test_empty_plans_space_the_next_ones_out_up_to_a_limit() -> None:
    replan = Replan()
    steps = planned_steps(replan, KEY, 100)
    assert steps[:EMPTY_STREAK] == list(range(EMPTY_STREAK))  # every step until the streak
    gaps = [b - a for a, b in zip(steps, steps[1:], strict=False)]
    assert gaps[EMPTY_STREAK - 1 : EMPTY_STREAK + 3] == [2, 4, 8, 16]
    assert max(gaps) == MAX_INTERVAL and gaps[-1] == MAX_INTERVAL
    assert planned_steps(replan, OTHER, 4) == [0, 1, 2, 3]  # each batch key has its own streak


def test_a_plan_that_drafts_resets_the_streak() -> None:
    replan = Replan()
    planned_steps(replan, KEY, 60)  # spaced out to MAX_INTERVAL
    while not replan.is_due(KEY):
        pass
    replan.record(KEY, is_empty=False)  # speculation pays again
    assert planned_steps(replan, KEY, 6, drafts=True) == [0, 1, 2, 3, 4, 5]


def test_a_batch_that_drafts_is_planned_every_step() -> None:
    assert planned_steps(Replan(), KEY, 50, drafts=True) == list(range(50))


def test_a_key_is_quiet_from_its_streak_of_empty_plans_until_one_drafts() -> None:
    replan = Replan()
    assert not replan.is_quiet(KEY)  # never planned
    for num_empty in range(1, EMPTY_STREAK + 1):
        replan.record(KEY, is_empty=True)
        assert replan.is_quiet(KEY) == (num_empty >= EMPTY_STREAK)
    assert not replan.is_quiet(OTHER)
    replan.record(KEY, is_empty=False)
    assert not replan.is_quiet(KEY)


def test_every_probe_every_th_empty_plan_in_a_row_is_a_probe() -> None:
    replan = Replan()
    assert not replan.is_probe_due(KEY)  # never planned
    due = []
    for num_empty in range(1, 2 * PROBE_EVERY + 2):
        replan.record(KEY, is_empty=True)
        if replan.is_probe_due(KEY):
            due.append(num_empty)
    assert due == [PROBE_EVERY, 2 * PROBE_EVERY]
    assert not replan.is_probe_due(OTHER)  # each batch key has its own streak
    replan.record(KEY, is_empty=False)  # a plan that drafts: the count starts again
    assert not replan.is_probe_due(KEY)
    for _ in range(PROBE_EVERY):
        replan.record(KEY, is_empty=True)
    assert replan.is_probe_due(KEY)


def test_a_probe_drafts_for_the_sequences_with_the_least_to_catch_up_on() -> None:
    """At most PROBE_MAX_SEQS of a batch, those whose proposer is the fewest tokens behind (the earlier of a
    tie), in batch order; a batch that small probes every sequence."""
    behind = [90, 3, 40, 3, 7, 12, 500, 1]
    assert PROBE_MAX_SEQS == 4
    assert probe_picks(behind) == [1, 3, 4, 7]
    assert probe_picks([5, 5, 5, 5, 5, 5]) == [0, 1, 2, 3]
    assert probe_picks([8, 2]) == [0, 1]
    assert probe_picks([]) == []


def test_probes_that_change_nothing_come_twice_as_far_apart_up_to_a_bound() -> None:
    """A probe after which the plans stay empty found the tables right: the next one comes twice as many empty
    plans on, then every MAX_PROBE_GAP; a plan that drafts starts the count again."""
    replan = Replan()
    due = []
    for num_empty in range(1, 300):
        replan.record(KEY, is_empty=True)
        if replan.is_probe_due(KEY):
            due.append(num_empty)
    assert MAX_PROBE_GAP == 64
    assert due == [8, 16, 32, 64, 128, 192, 256]
    replan.record(KEY, is_empty=False)
    due = [n for n in range(1, 20) if (replan.record(KEY, is_empty=True), replan.is_probe_due(KEY))[1]]
    assert due == [PROBE_EVERY, 2 * PROBE_EVERY]
