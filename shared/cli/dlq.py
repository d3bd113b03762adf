"""`specfleet dlq list|retry|purge`: jobs that exhausted max_deliveries, straight against Redis (REDIS_URL).

See shared/dlq.py for what a retry does (the job resumes after its output so far)."""

import json
from typing import Annotated

import typer

app = typer.Typer(no_args_is_help=True, help="Dead letters: jobs whose worker died max_deliveries times")


def _dead_letters():  # type: ignore[no-untyped-def]  # noqa: ANN202
    import redis

    from shared.dlq import DeadLetters
    from shared.settings import get_settings

    settings = get_settings()
    if settings.redis_url is None:
        typer.echo("error: set REDIS_URL (the Redis of the fleet)", err=True)
        raise typer.Exit(2)
    return DeadLetters(redis.Redis.from_url(settings.redis_url, decode_responses=True), settings)


@app.command("list")
def list_dead(as_json: Annotated[bool, typer.Option("--json", help="Print JSON")] = False) -> None:
    """Every dead-lettered job, oldest first: its status now, priority, tokens kept, deliveries."""
    letters = _dead_letters().list()
    if as_json:
        typer.echo(json.dumps([letter.public() for letter in letters]))
        return
    typer.echo(f"{'job id':34} {'status':10} {'priority':12} {'tokens':>7} {'deliveries':>10}")
    for d in letters:
        typer.echo(f"{d.job_id:34} {d.status:10} {d.priority:12} {d.completion_tokens:>7} {d.deliveries:>10}")


@app.command()
def retry(job_id: Annotated[str, typer.Argument(help="The dead-lettered job's id")]) -> None:
    """Put the job back in its queue with its output so far: the next worker resumes after it."""
    letters = _dead_letters()
    result = letters.retry(job_id)
    if result != "ok":
        reason = {"missing": "no such job (or its record expired)"}.get(
            result, "it is not a job that failed with max_deliveries_exceeded"
        )
        typer.echo(f"error: cannot retry {job_id}: {reason}", err=True)
        raise typer.Exit(1)
    typer.echo(f"requeued {job_id}")
    batch = letters.reopen_batch_line(job_id)
    if batch is not None:
        batch_id, answer = batch
        if answer in ("reopened", "uncounted"):
            typer.echo(f"its line in {batch_id} now waits for the retried job's result")
        else:
            typer.echo(f"note: batch {batch_id} is {answer}: its output keeps the line's failure; the retried "
                       "job's result is on the job only", err=True)


@app.command()
def purge(yes: Annotated[bool, typer.Option("--yes", help="Do not ask")] = False) -> None:
    """Empty the dead-letter list (the jobs stay failed until their result TTL)."""
    if not yes:
        typer.confirm("remove every dead letter?", abort=True)
    typer.echo(f"purged {_dead_letters().purge()} dead letters")


def register(root: typer.Typer) -> None:
    """Add the `dlq` group to `root`."""
    root.add_typer(app, name="dlq")
