"""`bench engine`'s run order: each variant runs first in turn (the one right after the bandwidth sample read
faster in a fixed order)."""

from workers.bench.engine_bench import rotated


def test_each_variant_runs_first_in_turn() -> None:
    names = ["eager", "auto", "unfused"]
    orders = [rotated(names, turn) for turn in range(4)]
    assert [order[0] for order in orders] == ["eager", "auto", "unfused", "eager"]
    assert all(sorted(order) == sorted(names) for order in orders)  # every variant runs every turn
    assert orders[1] == ["auto", "unfused", "eager"]  # the cycle kept: who ran after whom
    assert rotated([], 3) == []
