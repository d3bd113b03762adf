"""`specfleet batch submit|status|results|cancel|list`: batch files from the command line.

`submit FILE --wait` shows a live progress bar (completed/failed/total, rate, ETA) and writes the results
with `-o`. Exit status: 0 when the batch completed, 1 when it ended otherwise (failed, cancelled, expired)
or on an API error; Ctrl-C while waiting leaves the batch running and prints how to resume watching it.
"""

import json
import os
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import typer

batch_app = typer.Typer(
    no_args_is_help=True, help="Batch files (OpenAI Batch JSONL): submit, watch, results."
)

UrlOpt = Annotated[
    str | None, typer.Option("--url", help="Gateway URL (default: $SPECFLEET_URL or host:port)")
]
OutOpt = Annotated[Path | None, typer.Option("-o", "--output", help="Write the results JSONL here")]
POLL_S = 0.5
TERMINAL = ("completed", "failed", "expired", "cancelled")
EXIT_INTERRUPTED = 130


def _gateway_url(url: str | None) -> str:
    if url:
        return url
    if os.environ.get("SPECFLEET_URL"):
        return os.environ["SPECFLEET_URL"]
    from shared.settings import get_settings

    settings = get_settings()
    return f"http://{settings.host}:{settings.port}"


def _client(url: str | None):  # type: ignore[no-untyped-def]  # noqa: ANN202
    from gateway.batch_client import BatchClient

    return BatchClient(_gateway_url(url))


def _fail(exc: Exception) -> typer.Exit:
    typer.echo(f"error: {exc}", err=True)
    body = getattr(exc, "body", None)
    for line_error in (body or {}).get("error", {}).get("data", []):
        typer.echo(f"  line {line_error['line']}: {line_error['code']}: {line_error['message']}", err=True)
    return typer.Exit(1)


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
            batch = client.get(batch["id"])
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
        for chunk in client.results(batch_id):
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
    from gateway.client import FleetApiError as ApiError

    meta = dict(item.split("=", 1) for item in metadata or [] if "=" in item)
    with _client(url) as client:
        try:
            batch = client.submit(file, webhook=webhook, metadata=meta)
        except ApiError as exc:
            raise _fail(exc) from exc
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
    from gateway.client import FleetApiError as ApiError

    with _client(url) as client:
        try:
            batch = client.get(batch_id)
            if not wait:
                typer.echo(json.dumps(batch, indent=2))
                return
            _finish(client, _watch(client, batch), output)
        except ApiError as exc:
            raise _fail(exc) from exc


@batch_app.command()
def results(batch_id: str, output: OutOpt = None, url: UrlOpt = None) -> None:
    """Write the results JSONL (lines finished so far) to -o, or to stdout."""
    from gateway.client import FleetApiError as ApiError

    with _client(url) as client:
        try:
            if output is not None:
                _write_results(client, batch_id, output)
                return
            for chunk in client.results(batch_id):
                sys.stdout.buffer.write(chunk)
        except ApiError as exc:
            raise _fail(exc) from exc


@batch_app.command()
def cancel(batch_id: str, url: UrlOpt = None) -> None:
    """Cancel a batch: queued lines are cancelled, running ones finish."""
    from gateway.client import FleetApiError as ApiError

    with _client(url) as client:
        try:
            typer.echo(client.cancel(batch_id)["status"])
        except ApiError as exc:
            raise _fail(exc) from exc


@batch_app.command("list")
def list_batches(
    limit: Annotated[int, typer.Option(min=1, max=100)] = 20,
    after: Annotated[str | None, typer.Option(help="Last id of the previous page")] = None,
    url: UrlOpt = None,
) -> None:
    """List batches, newest first: id, status, completed/failed/total."""
    from gateway.client import FleetApiError as ApiError

    with _client(url) as client:
        try:
            page = client.list(limit, after)
        except ApiError as exc:
            raise _fail(exc) from exc
    for batch in page["data"]:
        c = batch["request_counts"]
        typer.echo(f"{batch['id']}  {batch['status']:<11} {c['completed']}/{c['failed']}/{c['total']}")
    if page["has_more"]:
        typer.echo(f"(more: --after {page['last_id']})", err=True)


def register(app: typer.Typer) -> None:
    app.add_typer(batch_app, name="batch")
