"""`specfleet batch submit|status|results|cancel|list`: batch files from the command line.

`submit FILE --wait` shows a live progress bar (completed/failed/total, rate, ETA) and writes the results
with `-o`. Exit status: 0 when the batch completed, 1 when it ended otherwise (failed, cancelled, expired)
or on an API error; Ctrl-C while waiting leaves the batch running and prints how to resume watching it.
"""

import json
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import typer

from shared.cli.common import UrlOpt, call, gateway_url

batch_app = typer.Typer(
    no_args_is_help=True, help="Batch files (OpenAI Batch JSONL): submit, watch, results."
)

OutOpt = Annotated[Path | None, typer.Option("-o", "--output", help="Write the results JSONL here")]
POLL_S = 0.5
TIMEOUT_S = 60.0  # per HTTP call (an upload can be large)
TERMINAL = ("completed", "failed", "expired", "cancelled")
EXIT_INTERRUPTED = 130


def _client(url: str | None):  # type: ignore[no-untyped-def]  # noqa: ANN202
    from shared.client import FleetClient

    return FleetClient(gateway_url(url), timeout_s=TIMEOUT_S)


def _watch(client: Any, batch: dict[str, Any]) -> dict[str, Any]:
    """Poll the batch with a progress bar until it ends; Ctrl-C leaves it running."""
    bar = None
    try:
        from tqdm import tqdm

        total = batch["request_counts"]["total"]
        bar = tqdm(total=total, unit="req", desc=batch["id"][:18], file=sys.stderr, dynamic_ncols=True)
        while True:
            counts = batch["request_counts"]
            bar.update(counts["completed"] + counts["failed"] - bar.n)
            bar.set_postfix_str(f"{batch['status']} ok={counts['completed']} failed={counts['failed']}")
            if batch["status"] in TERMINAL:
                return batch
            time.sleep(POLL_S)
            batch = client.get_batch(batch["id"])
    except KeyboardInterrupt:
        if bar is not None:
            bar.close()
        typer.echo(
            f"\nstopped watching; batch {batch['id']} keeps running. Resume with:\n"
            f"  specfleet batch status {batch['id']} --wait",
            err=True,
        )
        raise typer.Exit(EXIT_INTERRUPTED) from None
    finally:
        if bar is not None:
            bar.close()


def _write_results(client: Any, batch_id: str, output: Path) -> None:
    with output.open("wb") as f:
        for chunk in client.batch_results(batch_id):
            f.write(chunk)
    typer.echo(f"results written to {output}", err=True)


def _finish(client: Any, batch: dict[str, Any], output: Path | None) -> None:
    counts = batch["request_counts"]
    typer.echo(
        f"batch {batch['id']} {batch['status']}: {counts['completed']} completed, {counts['failed']} failed "
        f"of {counts['total']}",
        err=True,
    )
    if output is not None:
        _write_results(client, batch["id"], output)
    if batch["status"] != "completed":
        raise typer.Exit(1)


@batch_app.command()
def submit(
    file: Annotated[
        Path, typer.Argument(exists=True, dir_okay=False, help="JSONL input (OpenAI Batch lines)")
    ],
    wait: Annotated[bool, typer.Option("--wait", help="Watch with a progress bar until it ends")] = False,
    output: OutOpt = None,
    webhook: Annotated[str | None, typer.Option(help="POSTed the batch when it ends")] = None,
    metadata: Annotated[list[str] | None, typer.Option(help="key=value (repeatable)")] = None,
    url: UrlOpt = None,
) -> None:
    """Submit a batch file; print its id (with --wait: watch it, then write -o results)."""
    meta = dict(item.split("=", 1) for item in metadata or [] if "=" in item)
    with _client(url) as client:
        batch = call(lambda: client.submit_batch(file, webhook=webhook, metadata=meta))
        typer.echo(batch["id"])
        if wait:
            _finish(client, _watch(client, batch), output)


@batch_app.command()
def status(
    batch_id: str,
    wait: Annotated[bool, typer.Option("--wait", help="Watch with a progress bar until it ends")] = False,
    output: OutOpt = None,
    url: UrlOpt = None,
) -> None:
    """Print the batch as JSON (with --wait: watch it until it ends, then write -o results)."""
    with _client(url) as client:
        batch = call(lambda: client.get_batch(batch_id))
        if not wait:
            typer.echo(json.dumps(batch, indent=2))
            return
        call(lambda: _finish(client, _watch(client, batch), output))


@batch_app.command()
def results(batch_id: str, output: OutOpt = None, url: UrlOpt = None) -> None:
    """Write the results JSONL (lines finished so far) to -o, or to stdout."""
    def write() -> None:
        if output is not None:
            _write_results(client, batch_id, output)
            return
        for chunk in client.batch_results(batch_id):
            sys.stdout.buffer.write(chunk)

    with _client(url) as client:
        call(write)


@batch_app.command()
def cancel(batch_id: str, url: UrlOpt = None) -> None:
    """Cancel a batch: queued lines are cancelled, running ones finish."""
    with _client(url) as client:
        typer.echo(call(lambda: client.cancel_batch(batch_id))["status"])


@batch_app.command("list")
def list_batches(
    limit: Annotated[int, typer.Option(min=1, max=100)] = 20,
    after: Annotated[str | None, typer.Option(help="Last id of the previous page")] = None,
    url: UrlOpt = None,
) -> None:
    """List batches, newest first: id, status, completed/failed/total."""
    with _client(url) as client:
        page = call(lambda: client.list_batches(limit, after))
    for batch in page["data"]:
        c = batch["request_counts"]
        typer.echo(f"{batch['id']}  {batch['status']:<11} {c['completed']}/{c['failed']}/{c['total']}")
    if page["has_more"]:
        typer.echo(f"(more: --after {page['last_id']})", err=True)


def register(app: typer.Typer) -> None:
    """Add the `batch` group to `app`."""
    app.add_typer(batch_app, name="batch")
