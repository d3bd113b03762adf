"""Two variants of one pass timed against each other on this host, now: the start-up measurements behind
`compile: auto` (compilation.py) and `linear_packing: auto` (packing.py).

A start-up decision lasts the process's life, so one noisy measurement must not make it. The passes are timed in
pairs, one of each variant back to back, the order alternating from pair to pair, so a change of the host's speed
(these hosts swing by a fifth from one second to the next) hits both members of a pair alike. The verdict is a
sign test over the pairs: the variant is FASTER (or SLOWER) only when it won (or lost) so many pairs that a coin
would do so less than once in a hundred times; otherwise the two are the SAME here. Pairs are added a block at a
time until the test decides or MAX_PAIRS is reached, so a clear difference costs MIN_PAIRS pairs.
"""

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import TypeVar

MIN_PAIRS = 8  # the first block: 8 wins of 8 decide (p = 0.008)
MAX_PAIRS = 48
SIGNIFICANCE = 0.01  # two-sided sign-test p-value below which the verdict is not SAME

T = TypeVar("T")


class Verdict(StrEnum):
    """The variant (run(True)) against the base (run(False))."""

    FASTER = "faster"
    SLOWER = "slower"
    SAME = "same"  # no difference the pairs could tell from noise


@dataclass(frozen=True)
class Comparison:
    base_ms: float  # median ms of run(False)
    variant_ms: float  # median ms of run(True)
    num_pairs: int
    num_variant_wins: int  # pairs in which run(True) took less time than run(False)
    verdict: Verdict

    def describe(self) -> str:
        """e.g. '6.92 vs 8.91 ms, faster in 8 of 8 pairs' (variant first)."""
        return f"{self.variant_ms:.2f} vs {self.base_ms:.2f} ms, faster in {self.num_variant_wins} of {self.num_pairs} pairs"


def sign_test_p(num_wins: int, num_pairs: int) -> float:
    """Two-sided p-value of `num_wins` wins in `num_pairs` fair coin tosses (1.0 for no pairs)."""
    tail = min(num_wins, num_pairs - num_wins)
    p = 2 * sum(math.comb(num_pairs, k) for k in range(tail + 1)) / 2**num_pairs
    return min(p, 1.0)


def verdict_of(num_wins: int, num_pairs: int) -> Verdict:
    """FASTER / SLOWER when the sign test rejects a coin at SIGNIFICANCE, else SAME."""
    if sign_test_p(num_wins, num_pairs) >= SIGNIFICANCE:
        return Verdict.SAME
    return Verdict.FASTER if 2 * num_wins > num_pairs else Verdict.SLOWER


def time_interleaved(
    run: Callable[[bool], T], min_pairs: int = MIN_PAIRS, max_pairs: int = MAX_PAIRS
) -> tuple[Comparison, dict[bool, T]]:
    """run(False) (the base) against run(True) (the variant), in pairs (see the module's docstring), after one
    untimed pass of each; the comparison and the last output of each."""
    outputs = {variant: run(variant) for variant in (False, True)}  # one-time set-up stays out of the times
    times_ms: dict[bool, list[float]] = {False: [], True: []}
    num_wins = 0
    while len(times_ms[True]) < max_pairs:
        for _ in range(min_pairs):
            pair_ms = {}
            for variant in (False, True) if len(times_ms[True]) % 2 == 0 else (True, False):
                start_s = time.perf_counter()
                outputs[variant] = run(variant)
                pair_ms[variant] = (time.perf_counter() - start_s) * 1e3
                times_ms[variant].append(pair_ms[variant])
            num_wins += pair_ms[True] < pair_ms[False]
        if verdict_of(num_wins, len(times_ms[True])) is not Verdict.SAME:
            break
    num_pairs = len(times_ms[True])
    comparison = Comparison(statistics.median(times_ms[False]), statistics.median(times_ms[True]), num_pairs,
                            num_wins, verdict_of(num_wins, num_pairs))  # fmt: skip
    return comparison, outputs
