"""`specfleet tasks`: the Celery worker (webhook delivery, batch expansion/finalization, outbox bridge)."""

from typing import Annotated

import typer


def tasks(
    concurrency: Annotated[
        int | None, typer.Option(help="Threads (default: settings.celery_concurrency)")
    ] = None,
    name: Annotated[str, typer.Option(help="Celery node name (its outbox consumer name)")] = "tasks@%h",
    loglevel: Annotated[str, typer.Option(help="DEBUG | INFO | WARNING")] = "INFO",
) -> None:
    """Run the Celery worker for webhooks and batches (needs REDIS_URL)."""
    from shared.settings import get_settings

    settings = get_settings()
    if settings.redis_url is None:
        typer.echo("error: set REDIS_URL (or use `specfleet up`)", err=True)
        raise typer.Exit(2)
    from workers.tasks.celery_app import app

    app.worker_main(
        [
            "worker",
            "--pool=threads",
            f"--concurrency={concurrency or settings.celery_concurrency}",
            f"--hostname={name}",
            f"--loglevel={loglevel}",
            "--without-mingle",
            "--without-gossip",
        ]
    )


def register(app: typer.Typer) -> None:
    app.command()(tasks)
