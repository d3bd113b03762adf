"""`specfleet keys create|list|revoke`: API key management, straight against Redis (REDIS_URL).

`create` prints the secret once (it is stored only as a hash); `list` never shows a secret.
"""

import json
from typing import Annotated

import typer

from shared import redis_url as redis_urls

app = typer.Typer(no_args_is_help=True, help="API keys: create, list, revoke (stored hashed in Redis)")


def _registry():  # type: ignore[no-untyped-def]  # noqa: ANN202

    from shared.api_keys import KeyRegistry
    from shared.settings import get_settings

    settings = get_settings()
    url = settings.redis_url
    if url is None:
        typer.echo("error: set REDIS_URL (the Redis of the fleet)", err=True)
        raise typer.Exit(2)
    return KeyRegistry(redis_urls.client(url, decode_responses=True), settings.redis_partitions)


@app.command()
def create(
    name: Annotated[str, typer.Argument(help="A label for the key (a tenant, a service)")],
    requests_per_min: Annotated[
        int | None, typer.Option(help="Requests per rate_limit_period_s; 0 = no limit")
    ] = None,
    tokens_per_min: Annotated[
        int | None, typer.Option(help="Prompt + max_tokens per period; 0 = no limit")
    ] = None,
    max_concurrent_jobs: Annotated[
        int | None, typer.Option(help="Jobs queued or running at once; 0 = no limit")
    ] = None,
    admin: Annotated[
        bool, typer.Option("--admin", help="May read fleet stats and every tenant's jobs")
    ] = False,
    webhook_secret: Annotated[
        str | None, typer.Option(help="whsec_<base64> signing this key's webhooks (default: a new one)")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object")] = False,
) -> None:
    """Create a key and print its secret (shown only now)."""
    from shared.settings import get_settings

    settings = get_settings()
    try:
        key, secret = _registry().create(
            name,
            requests_per_min=settings.default_requests_per_min if requests_per_min is None else requests_per_min,
            tokens_per_min=settings.default_tokens_per_min if tokens_per_min is None else tokens_per_min,
            max_concurrent_jobs=settings.default_max_concurrent_jobs
            if max_concurrent_jobs is None
            else max_concurrent_jobs,
            is_admin=admin,
            webhook_secret=webhook_secret,
        )
    except ValueError as exc:  # a name, limit or webhook secret the key would work badly with
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
    if as_json:
        typer.echo(json.dumps({**key.public(), "key": secret, "webhook_secret": key.webhook_secret}))
        return
    typer.echo(f"id:             {key.id}")
    typer.echo(f"key:            {secret}")
    typer.echo(f"webhook secret: {key.webhook_secret}")
    typer.echo("store the key now: it is not shown again", err=True)


@app.command("list")
def list_keys(as_json: Annotated[bool, typer.Option("--json", help="Print JSON")] = False) -> None:
    """Every key (no secrets): id, name, limits, admin, revoked."""
    records = _registry().list()
    if as_json:
        typer.echo(json.dumps([k.public() for k in records]))
        return
    typer.echo(f"{'id':22} {'name':20} {'req/min':>8} {'tok/min':>10} {'jobs':>5} admin revoked")
    for k in records:
        typer.echo(
            f"{k.id:22} {k.name[:20]:20} {k.requests_per_min:>8} {k.tokens_per_min:>10} "
            f"{k.max_concurrent_jobs:>5} {'yes' if k.is_admin else 'no':5} {'yes' if k.revoked_at else 'no'}"
        )


@app.command()
def revoke(key_id: Annotated[str, typer.Argument(help="The key's id (key_...)")]) -> None:
    """Revoke a key: its next request gets 401."""
    if not _registry().revoke(key_id):
        typer.echo(f"error: no key {key_id}", err=True)
        raise typer.Exit(1)
    typer.echo(f"revoked {key_id}")


def register(root: typer.Typer) -> None:
    """Add the `keys` group to `root`."""
    root.add_typer(app, name="keys")
