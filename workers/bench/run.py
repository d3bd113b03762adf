"""Entry points of `specfleet bench NAME`: load the demo pair, measure, print, write JSON."""

import typer

from workers.bench.report import format_table, machine_info, write_json
from workers.worker.loop_time import LoopPart


def bench_engine_command(quick: bool, json_path: str | None) -> int:
    from workers.bench.engine_bench import EngineBenchPlan, bench_engine
    from workers.demo.build import ensure_demo_pair
    from workers.demo.corpus import held_out_prompts
    from workers.demo.eagle_build import ensure_demo_head
    from workers.engine.config import EngineConfig

    plan = EngineBenchPlan.quick() if quick else EngineBenchPlan()
    pair = ensure_demo_pair()
    result = bench_engine(pair.target_dir, held_out_prompts(max(plan.num_bs1_prompts, 8)), plan, EngineConfig.load(),
                          pair.draft_dir, ensure_demo_head(pair))
    typer.echo(format_table(result["rows"], ["system", "concurrency", "tokens_per_s", "greedy_match_vs_hf"]))
    typer.echo("")
    bound, compiled = result["bandwidth_bound"], result["compile"]
    samples = ", ".join(f"{gb_s:.1f}" for gb_s in bound["read_bandwidth_samples_gb_s"])
    typer.echo(f"batch-1 decode {bound['decode_tokens_per_s']:.1f} tok/s; bandwidth bound "
               f"{bound['bound_tokens_per_s']:.1f} tok/s ({bound['weight_bytes_per_token'] / 1e6:.1f} MB of weights "
               f"a token at {bound['read_bandwidth_gb_s']:.1f} GB/s, one thread: the median of {samples})")
    typer.echo("start-up s: " + ", ".join(f"{k} {v:.1f}" for k, v in compiled["start_up_s"].items()))
    for model, st in compiled["stats"].items():
        typer.echo(f"{model}: compiled {st['is_compiled']} in {st['compile_time_s']:.1f} s; eager ms "
                   f"{st['eager_ms']}, compiled ms {st['compiled_ms']}, failures {st['num_failures']}")
    for model, st in compiled["fused_layers"].items():
        typer.echo(f"{model}: native layers for passes of up to {st['max_tokens']} tokens ({st['reason']})")
    if compiled.get("native_build"):
        typer.echo(f"native kernels: the {compiled['native_build']['build']} build ({compiled['native_build']['reason']})")
    for model, choice in compiled["small_pass_threads"].items():
        typer.echo(f"{model}: small passes on {choice['num_threads']} thread(s) ({choice['reason']})")
    for proposer in ("draft", "eagle"):
        if f"{proposer}_ms_per_token" in compiled:
            per_token = compiled[f"{proposer}_ms_per_token"]
            typer.echo(f"{proposer} ms/token: " + ", ".join(f"{k} {v:.2f}" for k, v in per_token.items()))
    typer.echo("")
    for key, value in result["ratios"].items():
        typer.echo(f"{key}: {value:.2f}")
    if json_path:
        machine = machine_info(dtype=result["dtype"], new_tokens=plan.num_new_tokens, quick=quick,
                               bandwidth_bound=bound, compile=compiled)
        write_json(json_path, "engine", machine, result["rows"], result["ratios"])
    return 0


def bench_spec_command(quick: bool, json_path: str | None) -> int:
    from workers.bench.spec_bench import SpecBenchPlan, bench_spec
    from workers.demo.build import ensure_demo_pair
    from workers.demo.corpus import held_out_prompts
    from workers.demo.eagle_build import ensure_demo_head
    from workers.engine.config import EngineConfig

    plan = SpecBenchPlan.quick() if quick else SpecBenchPlan()
    pair = ensure_demo_pair()
    eagle_dir = ensure_demo_head(pair)
    prompts = held_out_prompts(max(plan.num_bs1_prompts, 8))
    result = bench_spec((pair.target_dir, pair.draft_dir), prompts, plan, EngineConfig.load(), eagle_dir)
    columns = ["system", "batch", "tokens_per_s", "tau", "acceptance_rate", "chosen_draft_tokens_per_seq_step",
               "vetoed_step_share", "match_vs_plain", "json_valid", "schema_valid"]
    typer.echo(format_table(result["rows"], columns))
    typer.echo("")
    for key, value in result["ratios"].items():
        typer.echo(f"{key}: {value:.3f}")
    packing = result["linear_packing"]
    typer.echo("linear weights packed: " + "; ".join(
        f"{name} " + " ".join(f"{model} {'yes' if on else 'no'}" for model, on in models.items())
        for name, models in packing.items()))  # fmt: skip
    if len({is_packed for models in packing.values() for is_packed in models.values()}) > 1:
        typer.echo("(the engines' start-up packing decisions differ: their ratios include it)")
    if json_path:
        machine = machine_info(
            dtype=result["dtype"], new_tokens=plan.num_new_tokens, quick=quick, tree_size=plan.tree_size,
            eagle_head=result.get("eagle_head"), linear_packing=packing,
        )  # fmt: skip
        write_json(json_path, "spec", machine, result["rows"], result["ratios"])
    return 0


def bench_e2e_command(
    quick: bool, json_path: str | None, model: str = "tiny", phase: str | None = None, work_dir: str | None = None
) -> int:
    import tempfile
    from pathlib import Path

    from workers.bench.e2e_bench import E2EBenchPlan, bench_e2e

    plan = E2EBenchPlan.quick() if quick else E2EBenchPlan()
    if phase not in (None, "mixed"):
        typer.echo(f"error: --phase must be mixed (or left out: every phase), not {phase!r}", err=True)
        return 2
    with tempfile.TemporaryDirectory(prefix="specfleet-models-") as tmp:
        eagle_dir = None  # the tiny pair has no head: its engines speculate with the draft model
        if model == "tiny":
            from workers.demo.tiny import make_tiny_pair

            target_dir, draft_dir = make_tiny_pair(Path(tmp))
        elif model == "demo":
            try:
                from workers.demo.build import ensure_demo_pair
            except ImportError:
                typer.echo("error: the demo pair builder (workers.demo.build) is not available; use --model tiny",
                           err=True)
                return 2
            from workers.demo.eagle_build import ensure_demo_head

            pair = ensure_demo_pair()
            target_dir, draft_dir, eagle_dir = pair.target_dir, pair.draft_dir, ensure_demo_head(pair)
        else:
            typer.echo(f"error: --model must be tiny or demo, not {model!r}", err=True)
            return 2
        result = bench_e2e(target_dir, draft_dir, plan, work_dir=Path(work_dir) if work_dir else None, only=phase,
                           settle_gc=True, eagle_dir=eagle_dir)
    print_e2e(result)
    if json_path:
        machine = machine_info(model=model, quick=quick, **result["engine"])
        write_json(json_path, "e2e", machine, result["rows"], result["ratios"])
    return 0


def print_e2e(result: dict) -> None:
    rows = result["rows"]
    tables = (
        (("ceiling", "submit"), ["phase", "system", "concurrency", "ops_per_s", "client_cpu_ms_per_job",
                                 "gateway_cpu_ms_per_job", "redis_cpu_ms_per_job"]),
        (("latency",), ["system", "concurrency", "ttft_ms_p50", "ttft_ms_p99", "tpot_ms_p50", "tpot_ms_p99",
                        "tokens_per_s", "num_requests"]),
        (("cost",), ["system", "concurrency", "speculation", "tokens", "compute_s_per_1k", "cost_per_1k"]),
        (("sse",), ["system", "concurrency", "peak_open", "token_events", "lost_tokens", "out_of_order",
                    "failed_jobs", "gateway_cpu_s"]),
        (("mixed",), ["system", "num_requests", "ttft_ms_p50", "ttft_ms_p99", "tokens_per_s", "seconds"]),
    )  # fmt: skip
    for phases, columns in tables:
        phase_rows = [r for r in rows if r["phase"] in phases]
        if phase_rows:  # `--phase mixed` runs that one alone
            typer.echo(format_table(phase_rows, columns))
            typer.echo("")
    fleet_cpu = [r for r in rows if r["phase"] == "latency" and "worker_cpu_us_per_token" in r]
    if fleet_cpu:  # the fleet's CPU per generated token, by process (the I/O core's share: gateway to client)
        names = ("gateway", "redis", "writer", "celery", "client", "worker")
        typer.echo(format_table(fleet_cpu, ["system", "concurrency", *(f"{n}_cpu_us_per_token" for n in names)]))
        typer.echo("")
    steps = [r for r in rows if r["phase"] == "latency" and "tokens_per_engine_step" in r]
    if steps:  # the worker loop's wall time by part, and the tokens an engine step made (the engine's too)
        parts = [f"loop_{part}_share" for part in LoopPart]
        typer.echo(format_table(steps, ["system", "concurrency", "tokens_per_engine_step", *parts]))
        typer.echo("")
    for key, value in result["ratios"].items():
        typer.echo(f"{key}: {value:.3f}")


def bench_report_command(quick: bool, json_path: str | None, out: str | None = None) -> int:
    import datetime
    import os
    from pathlib import Path

    from workers.bench.full_report import (
        ReportPlan,
        default_out_dir,
        git_commit,
        print_summary,
        run_benches,
        write_combined_json,
        write_report,
    )
    from workers.demo.build import ensure_demo_pair
    from workers.demo.corpus import held_out_prompts
    from workers.engine.config import EngineConfig

    today, commit = datetime.date.today(), git_commit()  # of the code measured, taken before it runs
    load_start = os.getloadavg()[0]
    plan = ReportPlan.of(quick)
    pair = ensure_demo_pair()
    prompts = held_out_prompts(max(plan.engine.num_bs1_prompts, plan.spec.num_bs1_prompts, 8))
    results = run_benches((pair.target_dir, pair.draft_dir), prompts, plan, EngineConfig.load(), settle_gc=True)
    meta = {"date": today.isoformat(), "commit": commit, "quick": quick, "model": pair.target_dir.parent.name,
            "new_tokens": plan.spec.num_new_tokens, "load_avg_1min": [load_start, os.getloadavg()[0]]}
    path = write_report(results, Path(out) if out else default_out_dir(today, commit), meta)
    typer.echo(print_summary(results))
    typer.echo(f"\nreport: {path}")
    if json_path:
        write_combined_json(json_path, results, meta)
    return 0
