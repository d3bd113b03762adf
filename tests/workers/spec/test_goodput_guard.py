"""GoodputGuard: speculation vetoed per batch-size key where its steps delivered fewer tokens per second than
plain steps, with trials spaced by how much a trial costs."""

import pytest

from workers.spec.goodput_guard import GoodputGuard, guard_key

KEY = guard_key(16, False, ("draft",))


def feed(guard: GoodputGuard, speculative: tuple[int, float], plain: tuple[int, float], times: int = 8) -> None:
    """`times` steps of each kind: (tokens, seconds)."""
    for _ in range(times):
        guard.observe(KEY, True, *speculative)
        guard.observe(KEY, False, *plain)


def test_batch_sizes_share_a_key_by_power_of_two_and_prefill_and_proposers_split_it() -> None:
    buckets = [guard_key(n, False, ("draft",))[0] for n in (1, 2, 3, 4, 5, 8, 9, 16, 17, 32)]
    assert buckets == [0, 1, 2, 2, 3, 3, 4, 4, 5, 5]
    assert guard_key(16, True, ("draft",)) != guard_key(16, False, ("draft",))
    assert guard_key(16, False, ("draft",)) != guard_key(16, False, ("draft", "eagle"))


def test_nothing_is_vetoed_until_both_kinds_of_step_were_seen() -> None:
    guard = GoodputGuard(min_samples=4)
    for _ in range(10):  # speculative steps alone, however slow: no plain figure to compare them with
        guard.observe(KEY, True, 16, 1.0)
    assert guard.ratio(KEY) is None and guard.allows(KEY)
    for _ in range(3):
        guard.observe(KEY, False, 16, 0.01)
    assert guard.ratio(KEY) is None and guard.allows(KEY)
    guard.observe(KEY, False, 16, 0.01)
    assert guard.ratio(KEY) == pytest.approx(0.01)
    assert not guard.allows(KEY)


def test_speculation_that_pays_is_never_vetoed() -> None:
    guard = GoodputGuard()
    feed(guard, speculative=(40, 0.02), plain=(16, 0.01))  # 2,000 against 1,600 tokens/s
    assert guard.ratio(KEY) == pytest.approx(1.25)
    assert all(guard.allows(KEY) for _ in range(100))


def test_a_vetoed_key_is_tried_once_an_interval_that_bounds_what_trials_cost() -> None:
    guard = GoodputGuard(max_regret=0.01, max_interval=256)
    feed(guard, speculative=(18, 0.0125), plain=(16, 0.01))  # 1,440 against 1,600 tokens/s: ratio 0.9
    assert guard.ratio(KEY) == pytest.approx(0.9)
    # a trial takes 1.25 plain steps and loses 0.1 of that: one in 13 steps costs 0.94 % of the time, one in 12
    # would cost 1.02 %
    assert guard.interval(0.9, 1.25) == 13
    assert [guard.allows(KEY) for _ in range(39)] == ([False] * 12 + [True]) * 3
    assert guard.interval(0.9) == 10  # as long as a plain step: one in ten costs 1 %
    assert guard.interval(0.995) == 1  # a near tie is tried every step
    assert guard.interval(0.2) == 80
    assert guard.interval(0.2, 4.0) == 256  # a clear loss, four steps long: still at least once in max_interval


@pytest.mark.parametrize("ratio, step_time_ratio", [(0.9, 1.0), (0.9, 1.25), (0.6, 2.0), (0.3, 3.7), (0.98, 5.0)])
def test_trials_cost_at_most_max_regret_of_the_time(ratio: float, step_time_ratio: float) -> None:
    """One trial (step_time_ratio plain steps long, delivering `ratio` of the plain rate) in every interval's
    steps: the time it loses against plain decoding, over the interval's time, is at most max_regret, and one
    step fewer would exceed it (unless the interval is 1)."""
    guard = GoodputGuard(max_regret=0.01, max_interval=10_000)

    def regret(n: int) -> float:
        return step_time_ratio * (1.0 - ratio) / ((n - 1) + step_time_ratio)

    n = guard.interval(ratio, step_time_ratio)
    assert regret(n) <= 0.01 + 1e-12
    assert n == 1 or regret(n - 1) > 0.01


def test_the_interval_follows_how_long_the_keys_speculative_steps_take() -> None:
    """Speculative steps 8x as long as plain ones for the same tokens (ratio 0.125): a trial loses 7 plain steps'
    time, so trials come 693 steps apart (0.99 % of the time), not the 88 that equally long steps would need."""
    guard = GoodputGuard(max_regret=0.01, max_interval=1000)
    feed(guard, speculative=(16, 0.08), plain=(16, 0.01))  # ratio 0.125, speculative steps 8x as long
    assert guard.ratio(KEY) == pytest.approx(0.125)
    allowed = [guard.allows(KEY) for _ in range(2 * 693)]
    assert guard.interval(0.125, 8.0) == 693 and guard.interval(0.125) == 88
    assert allowed.index(True) + 1 == 693 and allowed.count(True) == 2


def test_a_key_recovers_when_its_speculative_steps_deliver_again() -> None:
    guard = GoodputGuard(weight=0.1)
    feed(guard, speculative=(16, 0.02), plain=(16, 0.01))
    assert not guard.allows(KEY)
    for _ in range(8):  # the trials find speculation paying again (acceptance rose, the host changed)
        guard.observe(KEY, True, 48, 0.02)
    assert guard.ratio(KEY) > 1.0 and guard.allows(KEY)


def test_a_veto_from_a_slow_minute_lifts_within_a_few_trials() -> None:
    """A hundred slow speculative steps (the host stalled while they ran) veto the key; the trials then find
    speculative steps at twice the plain rate, and each weighs trial_weight, so five trials lift the veto
    where a hundred steps of ordinary weight would have been needed."""
    guard = GoodputGuard()
    feed(guard, speculative=(16, 0.04), plain=(16, 0.01), times=100)
    trials = 0
    for _ in range(2000):
        if guard.allows(KEY):
            if not guard.is_vetoed(KEY):
                break
            trials += 1
            guard.observe(KEY, True, 40, 0.0125)  # the trial: 3,200 tokens/s against 1,600
        else:
            guard.observe(KEY, False, 16, 0.01)
    assert not guard.is_vetoed(KEY) and trials <= 6


def test_a_shortfall_within_the_steps_spread_is_no_veto() -> None:
    """Speculative steps 10 % short on average: a veto where steps are steady or swing by 10 %, none where
    single steps swing by half (a stalled host): the averages then cannot tell 10 % apart."""
    for swing, is_vetoed in ((0.0, True), (0.1, True), (0.5, False)):
        guard = GoodputGuard()
        for i in range(200):
            scale = 1.0 + (swing if i % 2 else -swing)
            guard.observe(KEY, True, 18, 0.0125 * scale)
            guard.observe(KEY, False, 16, 0.01 * scale)
        assert guard.ratio(KEY) == pytest.approx(0.9)
        assert guard.is_vetoed(KEY) == is_vetoed, swing


def test_tokens_and_seconds_are_averaged_apart() -> None:
    """The rate is the ratio of the averages: a step's weight is its length, not one vote per step."""
    guard = GoodputGuard(min_samples=1)
    guard.observe(KEY, False, 10, 0.01)  # 1,000 tokens/s
    guard.observe(KEY, False, 10, 0.03)  # 333 tokens/s: averages 10 tokens in 0.02 s, 500/s (not 667/s)
    guard.observe(KEY, True, 500, 1.0)
    assert guard.ratio(KEY) == pytest.approx(1.0)


def test_keys_are_judged_apart_and_empty_steps_are_ignored() -> None:
    guard = GoodputGuard()
    feed(guard, speculative=(16, 0.02), plain=(16, 0.01))
    other = guard_key(1, False, ("draft",))
    assert not guard.allows(KEY) and guard.allows(other) and guard.ratio(other) is None
    guard.observe(other, True, 0, 0.01)  # a step that emitted nothing (every sequence aborted)
    guard.observe(other, False, 4, 0.0)  # and a clock that did not move
    assert guard.ratio(other) is None


@pytest.mark.parametrize(
    "bad", [{"weight": 0.0}, {"weight": 1.5}, {"max_regret": 0.0}, {"max_regret": 1.0}, {"min_samples": 0},
            {"max_interval": 0}, {"confidence_z": -1.0}, {"trial_weight": 0.01}, {"trial_weight": 1.5}]
)  # fmt: skip
def test_settings_are_checked(bad) -> None:
    with pytest.raises(ValueError):
        GoodputGuard(**bad)
