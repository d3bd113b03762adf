"""`specfleet load --url URL --rate R --duration S [--prompts FILE] [--json PATH]`: an open-loop load test of a
running fleet (shared/load.py): a table of throughput, TTFT/TPOT/end-to-end percentiles, errors and goodput."""

import asyncio
import json
import os
from pathlib import Path
from typing import Annotated

import typer

from shared.cli.common import UrlOpt, gateway_url


def load(
    url: UrlOpt = None,
    rate: Annotated[float, typer.Option(min=0.01, help="Mean arrivals per second (Poisson)")] = 2.0,
    duration: Annotated[float, typer.Option(min=0.1, help="Seconds of arrivals")] = 10.0,
    prompts: Annotated[
        Path | None,
        typer.Option(exists=True, dir_okay=False, readable=True,
                     help="Prompts, one a line (or a JSONL of {\"prompt\": ...})"),  # fmt: skip
    ] = None,
    max_tokens: Annotated[int, typer.Option(min=1, help="Tokens per request")] = 32,
    stream_fraction: Annotated[float, typer.Option(min=0.0, max=1.0, help="Share of streaming clients")] = 0.5,
    slo_ttft_ms: Annotated[float, typer.Option(help="Goodput: TTFT at most this")] = 1000.0,
    slo_tpot_ms: Annotated[float, typer.Option(help="Goodput: time per output token at most this")] = 100.0,
    seed: Annotated[int, typer.Option(help="Arrivals, priorities and clients are drawn from this seed")] = 0,
    json_path: Annotated[str | None, typer.Option("--json", help="Write the report as JSON here")] = None,
) -> None:
    """Open-loop load test: Poisson arrivals, mixed priorities, streaming and polling clients."""
    from shared.client import API_KEY_ENV
    from shared.load import DEFAULT_PROMPTS, LoadPlan, run_load

    plan = LoadPlan(
        rate_per_s=rate, duration_s=duration, prompts=read_prompts(prompts) if prompts else DEFAULT_PROMPTS,
        max_tokens=max_tokens, stream_fraction=stream_fraction, slo_ttft_ms=slo_ttft_ms, slo_tpot_ms=slo_tpot_ms,
        seed=seed,
    )
    report = asyncio.run(run_load(gateway_url(url), os.environ.get(API_KEY_ENV), plan))
    typer.echo(f"sent {report.num_sent}, succeeded {report.num_ok} in {report.elapsed_s:.1f} s "
               f"(clients {report.by_client}, priorities {report.by_priority})")
    typer.echo(f"throughput {report.requests_per_s:.2f} req/s, {report.tokens_per_s:.1f} tok/s; goodput "
               f"{report.goodput_per_s:.2f} req/s (TTFT <= {slo_ttft_ms:g} ms, TPOT <= {slo_tpot_ms:g} ms)")
    typer.echo(f"{'ms':6} {'p50':>9} {'p90':>9} {'p99':>9}")
    for name, values in report.percentiles_ms.items():
        typer.echo(f"{name:6} {values['p50']:>9.1f} {values['p90']:>9.1f} {values['p99']:>9.1f}")
    typer.echo(f"errors: {report.errors or 'none'}")
    if json_path:
        Path(json_path).write_text(json.dumps(report.to_json(), indent=2))


def read_prompts(path: Path) -> tuple[str, ...]:
    """One prompt a line; lines that are JSON objects give their `prompt`."""
    prompts = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        if not line.lstrip().startswith("{"):
            prompts.append(line)
            continue
        try:  # a JSONL line: its `prompt`, named by its line where it has none (it was a traceback)
            prompts.append(str(json.loads(line)["prompt"]))
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise typer.BadParameter(f"{path} line {number}: a JSON line needs a \"prompt\" ({exc!r})",
                                     param_hint="--prompts") from exc  # fmt: skip
    if not prompts:
        raise typer.BadParameter(f"{path} holds no prompt", param_hint="--prompts")
    return tuple(prompts)


def register(root: typer.Typer) -> None:
    """Add `load` to `root`."""
    root.command()(load)
