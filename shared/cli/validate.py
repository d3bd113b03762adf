"""`specfleet validate [--url URL] [--json PATH] [--prompts FILE]`: the launch checklist against a running fleet
(shared/validation.py).

The speculation checks judge the draft on the workload the model serves: `--prompts FILE` (one a line, or a JSONL
of {"prompt": ...}), else, when the fleet serves the demo pair (`/v1/models` says `demo`), prompts from the held-out
files of its corpus (never trained on: workers/demo/corpus.py), else generic code prompts (shared/load.py).
Prints a pass/fail table, writes `{"checks": [{"name", "passed", "value", "limit"}, ...]}` with --json, and exits
1 naming every failed check (a skipped check, `passed: null`, fails nothing). Sends `$SPECFLEET_API_KEY`."""

import json
import os
from pathlib import Path
from typing import Annotated

import typer

from shared.cli.common import DEMO_MODEL_NAME, UrlOpt, gateway_url


def validate(
    url: UrlOpt = None,
    json_path: Annotated[str | None, typer.Option("--json", help="Write the checks as JSON here")] = None,
    max_rejection_rate: Annotated[float, typer.Option(help="Draft tokens rejected, at most")] = 0.15,
    min_token_match: Annotated[float, typer.Option(help="Greedy SD vs plain: positions that agree")] = 0.98,
    min_bleu: Annotated[float, typer.Option(help="Greedy SD vs plain: corpus BLEU over tokens")] = 0.95,
    max_ttft_p50_ms: Annotated[float, typer.Option(help="Under the short load")] = 500.0,
    max_ttft_p99_ms: Annotated[float, typer.Option(help="Under the short load")] = 2000.0,
    max_tpot_p50_ms: Annotated[float, typer.Option(help="Under the short load")] = 100.0,
    max_tpot_p99_ms: Annotated[float, typer.Option(help="Under the short load")] = 250.0,
    load_rate: Annotated[float, typer.Option(help="Arrivals per second of the short load")] = 4.0,
    load_duration: Annotated[float, typer.Option(help="Seconds of the short load")] = 3.0,
    webhook_secret: Annotated[
        str | None, typer.Option(help="The key's webhook secret (whsec_...); without it the webhook check is skipped")
    ] = None,
    webhook_host: Annotated[str, typer.Option(help="Where the fleet reaches this machine's receiver")] = "127.0.0.1",
    model_version: Annotated[str | None, typer.Option(help="The version the workers must serve")] = None,
    prompts: Annotated[
        Path | None, typer.Option(help="Prompts, one a line (or a JSONL of {\"prompt\": ...}); default: see above")
    ] = None,
) -> None:
    """Run the launch checklist against a running fleet; exit 1 when a check fails."""
    from shared.cli.load import read_prompts
    from shared.client import API_KEY_ENV
    from shared.validation import ValidationPlan, Validator, report_json

    base_url, api_key = gateway_url(url), os.environ.get(API_KEY_ENV)
    plan = ValidationPlan(
        prompts=read_prompts(prompts) if prompts else default_prompts(base_url, api_key),
        min_token_match=min_token_match, min_bleu=min_bleu, max_rejection_rate=max_rejection_rate,
        load_rate_per_s=load_rate, load_duration_s=load_duration, webhook_secret=webhook_secret,
        webhook_host=webhook_host, model_version=model_version,
    )
    plan.max_ttft_ms = {"p50": max_ttft_p50_ms, "p99": max_ttft_p99_ms}
    plan.max_tpot_ms = {"p50": max_tpot_p50_ms, "p99": max_tpot_p99_ms}
    checks = Validator(base_url, api_key, plan).run()
    typer.echo(f"{'check':26} {'result':6} {'value':40} limit")
    for c in checks:
        result = "SKIP" if c.passed is None else "PASS" if c.passed else "FAIL"
        typer.echo(f"{c.name:26} {result:6} {json.dumps(c.value)[:40]:40} {c.limit}")
    if json_path:
        Path(json_path).write_text(json.dumps(report_json(checks), indent=2))
    failed = [c.name for c in checks if c.passed is False]
    if failed:
        typer.echo(f"validate: failed: {', '.join(failed)}", err=True)
        raise typer.Exit(1)
    typer.echo("validate: every check passed")


def default_prompts(base_url: str, api_key: str | None) -> tuple[str, ...]:
    """The demo corpus's held-out prompts when the fleet serves the demo pair, else generic code prompts."""
    import httpx

    from shared.load import DEFAULT_PROMPTS

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        models = httpx.get(f"{base_url}/v1/models", headers=headers, timeout=10).json().get("data", [])
    except (httpx.HTTPError, ValueError):
        return DEFAULT_PROMPTS  # the checklist itself reports an unreachable or refusing fleet
    if not any(m.get("id") == DEMO_MODEL_NAME for m in models):
        return DEFAULT_PROMPTS
    from workers.demo.corpus import held_out_prompts

    return tuple(held_out_prompts(NUM_DEMO_PROMPTS))


NUM_DEMO_PROMPTS = 8


def register(root: typer.Typer) -> None:
    """Add `validate` to `root`."""
    root.command()(validate)
