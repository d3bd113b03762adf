"""bench spec's closed loop on a real engine (tiny pair): the concurrency is held, every request runs to its
end with the same output as alone, and only the tokens emitted while every slot was busy are timed. Its rounds
alternate the variants' order."""

from pathlib import Path

from workers.bench.engine_bench import run_ours
from workers.bench.spec_bench import _Counters, round_orders, run_interleaved
from workers.engine.config import EngineConfig
from workers.engine.engine import Engine
from workers.spec.goodput_guard import guard_key


def test_closed_loop_keeps_the_concurrency_and_times_the_full_window(tiny_pair: tuple[Path, Path]) -> None:
    target, draft = tiny_pair
    engine = Engine(EngineConfig(target_dir=str(target), kv_cache_mb=16, max_num_seqs=8, num_threads=1), target,
                    draft)
    prompts = [engine.tokenizer.encode(text, add_special_tokens=False) for text in ("def f(x):", "import os", "class A:")]
    in_flight: list[int] = []
    step = engine.step

    def counting_step():  # type: ignore[no-untyped-def]
        in_flight.append(engine.num_unfinished())
        return step()

    engine.step = counting_step  # type: ignore[method-assign]
    num_tokens, seconds, outs = run_interleaved({"one": engine}, prompts, concurrency=2, num_new=12, num_requests=5)["one"]

    assert max(in_flight) == 2 and in_flight[0] == 2  # never more than the concurrency, full from the start
    assert [len(o) for o in outs] == [12] * 5  # every request ran to its end
    assert 3 * 12 <= num_tokens < 5 * 12 and seconds > 0  # 3 ended before the 5th began; the drain is not timed
    engine.step = step  # type: ignore[method-assign]
    for i, out in enumerate(outs):  # greedy: each output is what that prompt gives alone
        assert out == run_ours(engine, [prompts[i % len(prompts)]], 12)[1][0]


def test_engines_run_together_step_in_turn_and_time_their_own_steps(tiny_pair: tuple[Path, Path]) -> None:
    target, draft = tiny_pair
    engines = {
        name: Engine(EngineConfig(target_dir=str(target), kv_cache_mb=16, max_num_seqs=8, num_threads=1,
                                  speculative_method=method), target, draft)
        for name, method in (("plain", "none"), ("sd", "draft"))
    }  # fmt: skip
    prompts = [engines["plain"].tokenizer.encode(text, add_special_tokens=False) for text in ("def f(x):", "import os")]
    stepped: list[tuple[str, int]] = []  # (engine, requests in flight) before each step
    for name, engine in engines.items():
        step = engine.step

        def logged_step(name=name, step=step, engine=engine):  # type: ignore[no-untyped-def]
            stepped.append((name, engine.num_unfinished()))
            return step()

        engine.step = logged_step  # type: ignore[method-assign]
    results = run_interleaved(engines, prompts, concurrency=2, num_new=10, num_requests=4)

    # one step each in turn to the end: the one through its requests first went on with fillers, dropped at the end
    assert [name for name, _ in stepped] == ["plain", "sd"] * (len(stepped) // 2)
    assert min(in_flight for _, in_flight in stepped) == 2  # the concurrency held in every step of both
    for name, engine in engines.items():
        assert engine.num_unfinished() == 0
        num_tokens, seconds, outs = results[name]
        assert [len(o) for o in outs] == [10] * 4 and 2 * 10 <= num_tokens < 4 * 10 and seconds > 0
        del engine.step  # the instance's wrapper: back to the class's step
        for i, out in enumerate(outs):  # greedy: each output is what that prompt gives alone
            assert out == run_ours(engine, [prompts[i % len(prompts)]], 10)[1][0]
    # batch 1 in turn: each engine's prompts one after another, every token timed
    alone = run_interleaved(engines, prompts, concurrency=1, num_new=6, num_requests=2, time_to_the_end=True)
    assert all(num_tokens == 12 and seconds > 0 for num_tokens, seconds, _ in alone.values())


def test_rounds_run_every_variant_once_in_alternating_order() -> None:
    assert round_orders(["a", "b", "c"], 4) == [["a", "b", "c"], ["c", "b", "a"], ["a", "b", "c"], ["c", "b", "a"]]
    for num_rounds in (1, 2, 3):
        orders = round_orders(["a", "b"], num_rounds)
        assert len(orders) == num_rounds and all(sorted(order) == ["a", "b"] for order in orders)
        # the first and last variant of the plan are timed in the same stretches of the run
        positions = {name: sum(order.index(name) for order in orders) for name in ("a", "b")}
        assert abs(positions["a"] - positions["b"]) <= 1


def test_a_row_reports_the_share_of_planned_steps_the_guard_vetoed(tiny_pair: tuple[Path, Path]) -> None:
    target, draft = tiny_pair
    engine = Engine(
        EngineConfig(target_dir=str(target), kv_cache_mb=16, max_num_seqs=8, num_threads=1, speculative_method="draft"),
        target, draft,
    )  # fmt: skip
    prompts = [engine.tokenizer.encode(text, add_special_tokens=False) for text in ("def f(x):", "import os")]
    before = _Counters.of(engine)
    guard = engine.speculator.guard
    key = guard_key(2, False, ("draft",))  # two decoding sequences, no prefill: a tenth of plain's rate
    for _ in range(guard.min_samples):
        guard.observe(key, True, 2, 1.0)
        guard.observe(key, False, 2, 0.1)
    guard.observe = lambda *step: None  # type: ignore[method-assign]  # the veto holds for this run
    run_interleaved({"one": engine}, prompts, concurrency=2, num_new=12, num_requests=2)
    row = before.row(engine, "sd_draft_chain", 2, 1.0)
    vetoed, planned = engine.speculator.stats.num_vetoed_steps, sum(n for n, _ in engine.speculator.chosen_by_batch.values())
    assert vetoed == 11 and row["vetoed_step_share"] == vetoed / planned  # every decode step after the first token
    assert row["chosen_draft_tokens_per_seq_step"] == 0.0


def test_min_sd_vs_plain_names_the_slowest_row_with_its_rounds_standard_error() -> None:
    from workers.bench.spec_bench import _min_sd_vs_plain

    vs_plain = {("plain", 1): 1.0, ("plain", 16): 1.0, ("a", 1): 1.5, ("a", 16): 0.9, ("b", 1): 1.2, ("b", 16): 0.98}
    rounds = {("a", 16): [0.85, 0.95, 0.88, 0.92], ("a", 1): [1.5], ("b", 1): [1.2], ("b", 16): [0.98]}
    figures = _min_sd_vs_plain(vs_plain, rounds, ["a", "b"], (1, 16))
    assert figures["min_sd_vs_plain"] == 0.9  # a at 16
    assert abs(figures["min_sd_vs_plain_sem"] - 0.0222) < 1e-3  # stdev 0.0443 over 4 rounds, / sqrt(4)
    assert _min_sd_vs_plain(vs_plain, {**rounds, ("a", 16): [0.9]}, ["a", "b"], (1, 16))["min_sd_vs_plain_sem"] == 0.0
