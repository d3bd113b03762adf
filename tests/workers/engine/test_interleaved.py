"""The paired start-up comparison behind `compile: auto` and `linear_packing: auto` (workers/engine/interleaved.py):
the sign test's arithmetic, the verdicts it allows, and time_interleaved on passes whose order of cost is fixed
by a sleep (a pass that sleeps 2 ms is never the faster one of its pair)."""

import time

import pytest

from workers.engine.interleaved import (
    MAX_PAIRS,
    MIN_PAIRS,
    Verdict,
    sign_test_p,
    time_interleaved,
    verdict_of,
)

SLOW_S = 0.002


def test_the_sign_test_p_value() -> None:
    assert sign_test_p(8, 8) == sign_test_p(0, 8) == pytest.approx(2 / 256)
    assert sign_test_p(7, 8) == pytest.approx(2 * 9 / 256)  # 0, 1 (or 7, 8) wins of 8
    assert sign_test_p(4, 8) == sign_test_p(0, 0) == 1.0
    assert sign_test_p(34, 48) == sign_test_p(14, 48) < 0.01 < sign_test_p(33, 48)


def test_a_verdict_needs_more_than_a_coin_would_do() -> None:
    assert verdict_of(8, 8) is Verdict.FASTER and verdict_of(0, 8) is Verdict.SLOWER
    assert verdict_of(7, 8) is verdict_of(1, 8) is verdict_of(4, 8) is Verdict.SAME
    assert verdict_of(34, 48) is Verdict.FASTER and verdict_of(33, 48) is Verdict.SAME


def test_a_clear_difference_takes_one_block_of_pairs_in_alternating_order() -> None:
    calls: list[bool] = []

    def run(variant: bool) -> str:
        calls.append(variant)
        if not variant:
            time.sleep(SLOW_S)  # the base is the slow one
        return f"out-{variant}-{len(calls)}"

    comparison, outputs = time_interleaved(run)
    assert comparison.verdict is Verdict.FASTER
    assert comparison.num_pairs == comparison.num_variant_wins == MIN_PAIRS
    assert comparison.base_ms >= SLOW_S * 1e3 > comparison.variant_ms
    timed = calls[2:]  # after one untimed pass of each
    assert calls[:2] == [False, True] and len(timed) == 2 * MIN_PAIRS
    pairs = [tuple(timed[i : i + 2]) for i in range(0, len(timed), 2)]
    assert pairs == [(False, True), (True, False)] * (MIN_PAIRS // 2)  # the order alternates pair by pair
    assert outputs == {calls[-1]: f"out-{calls[-1]}-{len(calls)}", calls[-2]: f"out-{calls[-2]}-{len(calls) - 1}"}
    assert "faster in 8 of 8 pairs" in comparison.describe()


def test_no_clear_difference_measures_up_to_the_limit_and_says_same() -> None:
    num_calls = [0]

    def run(variant: bool) -> None:
        num_calls[0] += 1
        pair_index = (num_calls[0] - 3) // 2  # the two untimed passes first
        if variant == (pair_index % 2 == 0):  # each variant is the slow one in every other pair
            time.sleep(SLOW_S)

    comparison, _ = time_interleaved(run)
    assert comparison.verdict is Verdict.SAME
    assert comparison.num_pairs == MAX_PAIRS and comparison.num_variant_wins == MAX_PAIRS // 2


def test_a_slower_variant_is_slower() -> None:
    comparison, _ = time_interleaved(lambda variant: time.sleep(SLOW_S) if variant else None)
    assert comparison.verdict is Verdict.SLOWER and comparison.num_variant_wins == 0
