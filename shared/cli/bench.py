"""`specfleet bench NAME [--quick] [--json PATH]`: the benchmarks of workers/bench/ (a table; JSON optional)."""

import importlib
import os
from pathlib import Path
from typing import Annotated

import typer

# bench NAME -> "module:function"; each function takes (quick: bool, json_path: str | None) and returns 0/1
BENCHES = {
    "engine": "workers.bench.run:bench_engine_command",
    "spec": "workers.bench.run:bench_spec_command",
    "e2e": "workers.bench.run:bench_e2e_command",  # also takes --model tiny|demo, --phase mixed, --work-dir DIR
    "report": "workers.bench.run:bench_report_command",  # all three + a Markdown report; also takes --out DIR
    "warmup": "workers.bench.warmup_bench:bench_warmup_command",  # first-job TTFT vs steady, without/with warm-up
    "cost": "workers.bench.cost_bench:bench_cost_command",  # cost per 1,000 tokens per concurrency, SD on/off
    "prefix": "workers.bench.prefix_bench:bench_prefix_command",  # prefix caching on vs off: TTFT, tokens/s
    "tp": "workers.bench.tp_bench:bench_tp_command",  # the demo target over 2 tensor-parallel ranks vs 1
    "graphs": "workers.bench.graphs_bench:bench_graphs_command",  # CUDA only: decode graphs vs op by op
}


def bench(
    name: Annotated[str, typer.Argument(help=f"One of: {', '.join(BENCHES)}")],
    quick: Annotated[bool, typer.Option("--quick", help="A smaller run of the same measurement (< 3 min)")] = False,
    json_path: Annotated[str | None, typer.Option("--json", help="Write the results as JSON here")] = None,
    model: Annotated[str | None, typer.Option(help="e2e only: tiny (random weights, default) | demo")] = None,
    phase: Annotated[str | None, typer.Option(help="e2e only: run one phase alone (mixed)")] = None,
    work_dir: Annotated[
        str | None,
        typer.Option(help="e2e only: the fleet's folder (its Redis data and process logs), kept after the run "
                          "(default: a temporary folder, removed)"),
    ] = None,
    out: Annotated[
        str | None, typer.Option(help="report only: the report's folder (default: docs/bench/<date>-<commit>)")
    ] = None,
) -> None:
    """Run a benchmark: print a table, optionally write JSON."""
    if name not in BENCHES:
        typer.echo(f"error: unknown benchmark {name!r}; choose from {', '.join(BENCHES)}", err=True)
        raise typer.Exit(2)
    if model is not None and name != "e2e":
        typer.echo("error: --model is an option of the e2e benchmark only", err=True)
        raise typer.Exit(2)
    if phase is not None and name != "e2e":
        typer.echo("error: --phase is an option of the e2e benchmark only", err=True)
        raise typer.Exit(2)
    if work_dir is not None and name != "e2e":
        typer.echo("error: --work-dir is an option of the e2e benchmark only", err=True)
        raise typer.Exit(2)
    if out is not None and name != "report":
        typer.echo("error: --out is an option of the report only", err=True)
        raise typer.Exit(2)
    if json_path is not None:  # checked before minutes of measuring: the JSON was written (or not) at the end
        folder = Path(json_path).resolve().parent
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            typer.echo(f"error: --json {json_path}: cannot make its folder ({exc.strerror})", err=True)
            raise typer.Exit(2) from exc
        if not os.access(folder, os.W_OK) or Path(json_path).is_dir():
            typer.echo(f"error: --json {json_path}: not a file this process may write", err=True)
            raise typer.Exit(2)
    module, func = BENCHES[name].split(":")
    extra: dict[str, str] = {"model": model} if model is not None else {}
    if out is not None:
        extra["out"] = out
    if phase is not None:
        extra["phase"] = phase
    if work_dir is not None:
        extra["work_dir"] = work_dir
    raise typer.Exit(getattr(importlib.import_module(module), func)(quick=quick, json_path=json_path, **extra))


def register(app: typer.Typer) -> None:
    """Add this module's command to `app`."""
    app.command()(bench)
