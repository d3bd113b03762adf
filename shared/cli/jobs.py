"""`specfleet submit|status|stream|cancel`: one job over the gateway's HTTP API (shared/client.py); `jobs`: yours."""

import json
import sys
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Annotated

import typer

from shared.cli.common import UrlOpt, call, gateway_url

if TYPE_CHECKING:
    from shared.client import SseEvent


def submit(
    prompt: Annotated[str, typer.Argument(help="Prompt text")],
    max_tokens: Annotated[int, typer.Option()] = 128,
    temperature: Annotated[float, typer.Option(help="0 = greedy")] = 0.0,
    priority: Annotated[str, typer.Option(help="interactive | default | batch")] = "default",
    speculative: Annotated[str | None, typer.Option(help="none | draft | ngram | eagle")] = None,
    idempotency_key: Annotated[str | None, typer.Option()] = None,
    stream_interval_ms: Annotated[
        int | None, typer.Option(help="Token events at most this often, each with the tokens since the last")
    ] = None,
    stream: Annotated[
        bool, typer.Option("--stream", help="Stream the text instead of printing the job id")
    ] = False,
    fields: Annotated[
        list[str] | None,
        typer.Option(
            "--set",
            help="Any other field of the job, FIELD=VALUE (VALUE read as JSON, else as text); repeatable: "
            "--set seed=7 --set 'stop=[\"\\n\"]' --set 'structured_outputs={\"choice\": [\"yes\", \"no\"]}'",
        ),
    ] = None,
    url: UrlOpt = None,
) -> None:
    """Queue a job; print its id (or stream its text with --stream)."""
    from shared.client import FleetClient

    body: dict[str, object] = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "priority": priority,
    }
    if speculative is not None:
        body["speculative"] = speculative
    if stream_interval_ms is not None:
        body["stream_interval_ms"] = stream_interval_ms
    body.update(_set_fields(fields or []))
    with FleetClient(gateway_url(url)) as client:
        if stream:  # one request: the submit answers with the job's events
            _print_events(lambda: client.submit_stream(body, idempotency_key=idempotency_key))
            return
        job = call(lambda: client.submit(body, idempotency_key=idempotency_key))
        typer.echo(job["id"])


def _set_fields(pairs: list[str]) -> dict[str, object]:
    """--set FIELD=VALUE pairs -> the body's fields (a VALUE that is not JSON is text: `--set priority=batch`)."""
    fields: dict[str, object] = {}
    for pair in pairs:
        name, is_pair, raw = pair.partition("=")
        if not is_pair or not name:
            raise typer.BadParameter(f"{pair!r} is not FIELD=VALUE", param_hint="--set")
        try:
            fields[name] = json.loads(raw)
        except ValueError:
            fields[name] = raw
    return fields


def status(job_id: str, url: UrlOpt = None) -> None:
    """Print the job as JSON."""
    from shared.client import FleetClient

    with FleetClient(gateway_url(url)) as client:
        typer.echo(json.dumps(call(lambda: client.get(job_id)), indent=2))


def stream(
    job_id: str,
    url: UrlOpt = None,
    last_event_id: Annotated[str | None, typer.Option(help="Resume after this event id")] = None,
) -> None:
    """Stream a job's text as it is generated."""
    from shared.client import FleetClient

    with FleetClient(gateway_url(url)) as client:
        _print_events(lambda: client.stream(job_id, last_event_id))


def cancel(job_id: str, url: UrlOpt = None) -> None:
    """Cancel a queued or running job."""
    from shared.client import FleetClient

    with FleetClient(gateway_url(url)) as client:
        typer.echo(call(lambda: client.cancel(job_id))["status"])


def jobs(
    limit: Annotated[int, typer.Option(min=1, max=100)] = 20,
    after: Annotated[str | None, typer.Option(help="Last id of the previous page")] = None,
    status: Annotated[str | None, typer.Option(help="Only jobs in this status (queued, running, succeeded, ...)")] = None,
    url: UrlOpt = None,
) -> None:
    """List your jobs, newest first: id, status, tokens generated, when created (UTC)."""
    from shared.client import FleetClient

    with FleetClient(gateway_url(url)) as client:
        page = call(lambda: client.list_jobs(limit, after, status))
    for job in page["data"]:
        created = datetime.fromtimestamp(job["created_at"], UTC).strftime("%Y-%m-%d %H:%M:%S")
        typer.echo(f"{job['id']}  {job['status']:<9} {job['usage']['completion_tokens']:>6} tokens  {created}")
    if page["has_more"]:
        typer.echo(f"(more: --after {page['last_id']})", err=True)


def _print_events(events: Callable[[], Iterator["SseEvent"]]) -> None:
    def run() -> None:
        for event in events():
            if event.event == "token":
                sys.stdout.write(event.data["text"])
                sys.stdout.flush()
            elif event.event == "done":
                typer.echo(
                    f"\n[{event.data['status']}: {event.data['finish_reason']}, "
                    f"{event.data['usage']['completion_tokens']} tokens]",
                    err=True,
                )
            elif event.event == "error":
                typer.echo(f"\n[{event.data['status']}: {event.data['error']['message']}]", err=True)
                raise typer.Exit(1)

    call(run)


def register(app: typer.Typer) -> None:
    """Add this module's commands to `app`."""
    for command in (submit, status, stream, cancel, jobs):
        app.command()(command)
