"""PassCostTable: measured pass times by token count and attention over context, interpolated, tracking the host."""

import random

import pytest

from workers.spec.pass_costs import PAIR_ROWS_CAP, AttentionCost, AttentionWork, PassCostTable


def test_an_empty_table_refuses_to_guess() -> None:
    table = PassCostTable()
    assert not table.is_measured and table.estimate_s(0) == 0.0
    with pytest.raises(ValueError, match="no pass has been measured"):
        table.estimate_s(4)


def test_grid_points_are_exact_and_counts_between_them_interpolate() -> None:
    table = PassCostTable(max_tokens=64)
    table.observe(8, 0.010)
    table.observe(16, 0.018)
    assert table.estimate_s(8) == pytest.approx(0.010) and table.estimate_s(16) == pytest.approx(0.018)
    assert table.estimate_s(12) == pytest.approx(0.014)  # halfway
    assert table.estimate_s(2) == pytest.approx(0.010)  # below the smallest measured: never cheaper than it
    assert table.estimate_s(32) == pytest.approx(0.018 + 16 * 0.001)  # above the largest: at the last slope


def test_observations_move_the_estimate_toward_what_the_host_does_now() -> None:
    table = PassCostTable(max_tokens=64, rate=0.5)
    table.observe(4, 0.010)
    for _ in range(20):  # the host got twice as slow (a noisy neighbour)
        table.observe(4, 0.020)
    assert table.estimate_s(4) == pytest.approx(0.020, rel=1e-3)


def test_an_observation_between_grid_points_corrects_both_neighbours_by_weight() -> None:
    table = PassCostTable(max_tokens=64, rate=1.0)
    table.observe(8, 0.010)
    table.observe(12, 0.010)
    table.observe(10, 0.020)  # halfway: each neighbour moves by half the implied ratio
    assert table.estimate_s(8) == pytest.approx(0.015) and table.estimate_s(12) == pytest.approx(0.015)


def test_passes_beyond_the_grid_scale_onto_its_last_point() -> None:
    table = PassCostTable(max_tokens=64)
    table.observe(128, 0.128)
    assert table.grid[-1] == 64 and table.estimate_s(64) == pytest.approx(0.064)


def test_the_grid_is_fine_where_threads_and_dispatch_change_costs() -> None:
    assert PassCostTable(max_tokens=64).grid == [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64]
    assert PassCostTable(max_tokens=50).grid[-1] == 64  # the grid covers max_tokens


def test_one_stalled_measurement_does_not_make_a_size_look_dearer_than_a_bigger_pass() -> None:
    table = PassCostTable(max_tokens=64)
    for n, ms in [(8, 10.0), (12, 900.0), (16, 14.0)]:  # the 12-token pass waited on a busy core
        table.observe(n, ms / 1e3)
    assert table.estimate_s(12) == pytest.approx(0.014)
    assert table.estimate_s(8) == pytest.approx(0.010)
    for _ in range(40):  # real 12-token passes bring the stalled point back
        table.observe(12, 0.012)
    assert table.seconds[table.grid.index(12)] == pytest.approx(0.012, rel=0.01)


def test_a_size_measured_long_ago_neither_caps_the_sizes_measured_since_nor_undercuts_them() -> None:
    """Seen on the demo draft at 16 sequences on a host that slowed down after start-up: its 32-token point, from
    the start-up probe and never run again, held 0.93 ms and capped every size below it, which the run measured
    at 1.4-2.5 ms: the policy priced a step's draft passes at 3.0 ms against 6.7 ms. Between two sizes the one
    measured more recently decides."""
    table = PassCostTable(max_tokens=64)
    table.observe(8, 1.5e-3)
    table.observe(32, 0.93e-3)  # the probe's last, at a quiet moment
    assert table.estimate_s(8) == pytest.approx(0.93e-3)  # as measured then, a bigger pass bounds a smaller
    for _ in range(30):  # the run: passes of 8 tokens, on a host twice as slow
        table.observe(8, 2.0e-3)
    assert table.estimate_s(8) == pytest.approx(2.0e-3, rel=0.01)  # the stale point caps it no more
    assert table.estimate_s(32) >= table.estimate_s(16) >= table.estimate_s(8)  # raised to it: never cheaper
    table.observe(32, 2.5e-3)  # measured again: a fresh point, its own time
    assert table.estimate_s(32) == pytest.approx(table.seconds[table.grid.index(32)])


def test_a_stalled_size_never_costs_more_than_the_smaller_passes_it_splits_into() -> None:
    """Seen on a worker whose start-up probe ran beside another busy process: an EAGLE head at 0.89 ms for 3
    tokens and 67.8 ms for 6. Read as is, the head's catch-up looked dear, it never drafted, and no pass of 6
    ever ran again to correct it. Two passes of 3 bound it."""
    table = PassCostTable(max_tokens=64)
    for n, ms in ((1, 0.89), (2, 0.89), (3, 0.89), (4, 7.66), (6, 67.83), (8, 67.95)):
        table.observe(n, ms / 1e3)
    assert table.estimate_s(6) == pytest.approx(2 * 0.89e-3)
    assert table.estimate_s(4) == pytest.approx(2 * 0.89e-3)  # ceil(4 / 3) passes of 3
    assert table.estimate_s(8) == pytest.approx(3 * 0.89e-3)
    assert table.estimate_s(3) == pytest.approx(0.89e-3)  # the sizes that measured well keep their times
    assert table.seconds[table.grid.index(6)] == pytest.approx(67.83e-3)  # the raw point stays, to recover


def _envelope_by_its_rules(table: PassCostTable) -> list[float]:
    """The envelope's three rules applied one after the other as written, each point against every other."""
    points = [(g, s, at) for g, s, at in zip(table.grid, table.seconds, table._observed_at, strict=True) if s is not None]
    tokens = [g for g, _, _ in points]
    envelope = [s for _, s, _ in points]
    at = [a for _, _, a in points]
    for i in reversed(range(len(envelope))):  # capped by every bigger pass measured since (as it now stands)
        envelope[i] = min([envelope[i]] + [envelope[j] for j in range(i + 1, len(envelope)) if at[j] >= at[i]])
    for i in range(1, len(envelope)):  # raised to the smaller pass before it where that was measured later
        if at[i] < at[i - 1]:
            envelope[i], at[i] = max(envelope[i], envelope[i - 1]), at[i - 1]
    for i in range(1, len(envelope)):  # nor more than the smaller passes (as they now stand) it splits into
        envelope[i] = min([envelope[i]] + [-(-tokens[i] // tokens[j]) * envelope[j] for j in range(i)])
    return envelope


def test_the_envelope_is_its_rules_applied_one_after_the_other_for_any_history() -> None:
    """The envelope is remade after every step's observations, in the planner's path, so it is computed in one
    pass over pairs against the points as measured; the seconds are the rules' own, to the bit."""
    rng = random.Random(11)
    for _ in range(300):
        max_tokens = rng.choice([64, 512, 2048])
        table = PassCostTable(max_tokens=max_tokens)
        for _ in range(rng.randint(1, 50)):
            n = rng.randint(1, max_tokens + 40)
            table.observe(n, rng.choice([1e-3 + n * 2e-5, rng.uniform(1e-4, 5e-2)]))
            if rng.random() < 0.3:
                assert table._envelope()[1] == _envelope_by_its_rules(table)
        assert table._envelope()[1] == _envelope_by_its_rules(table)


def test_the_least_a_token_adds_is_the_smallest_slope_from_there_on() -> None:
    table = PassCostTable(max_tokens=64)
    for n in table.grid:
        table.observe(n, 10e-3 + (0.1e-3 * n if n <= 8 else 0.8e-3 + 0.5e-3 * (n - 8)))  # flat, then steep
    assert table.min_slope_s(1) == pytest.approx(0.1e-3)
    assert table.min_slope_s(8) == pytest.approx(0.5e-3)  # only the steep segments reach past 8
    assert table.min_slope_s(1000) == pytest.approx(0.5e-3)  # the extrapolation's slope
    flat = PassCostTable(max_tokens=64)
    flat.observe(1, 1e-3)
    assert flat.min_slope_s(1) == 0.0  # one point: nothing known of the slope


DEMO_LIKE = AttentionCost(s_per_key=0.3e-6, s_per_pair=0.2e-6)  # the demo target's rates at 16 sequences (bf16)


def decode_work(num_seqs: int, rows: int, context: int) -> AttentionWork:
    return AttentionWork(num_seqs * context, num_seqs * rows * context)


def test_a_size_measured_over_short_contexts_is_not_read_as_its_cost_over_long_ones() -> None:
    """What the table without context got wrong: the 24-token point, probed over 32-token contexts and seldom
    run since, read 7.6 ms while 16-token passes over the contexts of the run took 8.6 ms, so its envelope priced
    a 20-token verify no dearer than the plain 16-token pass (it took 9-10 ms). The dense part is what a point
    keeps; an estimate adds the attention of the pass asked about."""
    table = PassCostTable(max_tokens=64, attention=DEMO_LIKE)
    dense_s = {16: 5.0e-3, 24: 6.0e-3}
    table.observe(24, dense_s[24] + DEMO_LIKE.seconds(decode_work(16, 1, 32)), decode_work(16, 1, 32))  # start-up
    for _ in range(50):  # the run: 16 sequences decoding over 300 committed tokens each
        table.observe(16, dense_s[16] + DEMO_LIKE.seconds(decode_work(16, 1, 300)), decode_work(16, 1, 300))
    long_plain = decode_work(16, 1, 300)
    assert table.estimate_s(16, long_plain) == pytest.approx(dense_s[16] + DEMO_LIKE.seconds(long_plain))
    verify = long_plain + AttentionWork(0, 4 * 300)  # 4 of the sequences add a draft row each
    assert table.estimate_s(20, verify) > table.estimate_s(16, long_plain) + 4 * 0.1e-3
    assert table.estimate_s(24, decode_work(16, 1, 32)) == pytest.approx(dense_s[24] + DEMO_LIKE.seconds(
        decode_work(16, 1, 32)))  # the old context still reads as it was measured


def test_attention_never_takes_more_than_most_of_a_pass_out_of_the_table() -> None:
    """Rates from a probe that ran during a stall must not leave a point at nothing: a size that looks free
    would cap every smaller one through the envelope."""
    table = PassCostTable(max_tokens=64, attention=AttentionCost(s_per_key=1e-3))
    table.observe(16, 0.010, AttentionWork(num_keys=1000))  # "1 s of attention" in a 10 ms pass
    assert table.estimate_s(16) == pytest.approx(0.0025)  # a quarter of the pass is kept as its dense part


def test_a_long_prefill_chunk_counts_its_first_rows_as_attention_and_the_rest_as_dense() -> None:
    assert AttentionWork.of_rows(4, 100) == AttentionWork(100, 400)
    assert AttentionWork.of_rows(512, 100) == AttentionWork(100, PAIR_ROWS_CAP * 100)
    assert AttentionWork.of_rows(1, 7) + AttentionWork.of_rows(2, 5) == AttentionWork(12, 17)
