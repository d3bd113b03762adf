"""What the HTTP commands (jobs, batch) share: the --url option, the gateway URL, API errors on stderr."""

import os
from collections.abc import Callable
from typing import Annotated, TypeVar

import typer

T = TypeVar("T")

DEMO_MODEL_NAME = "demo"  # the model a worker serving the demo pair announces (`/v1/models`)

UrlOpt = Annotated[
    str | None, typer.Option("--url", help="Gateway URL (default: $SPECFLEET_URL or host:port)")
]


def gateway_url(url: str | None) -> str:
    if url:
        return url
    if os.environ.get("SPECFLEET_URL"):
        return os.environ["SPECFLEET_URL"]
    from shared.settings import get_settings

    settings = get_settings()
    return f"http://{settings.host}:{settings.port}"


def fail(exc: Exception) -> typer.Exit:
    """Print an API error (and each bad line of a refused batch) on stderr; the Exit to raise."""
    typer.echo(f"error: {exc}", err=True)
    body = getattr(exc, "body", None)
    for line_error in (body or {}).get("error", {}).get("data", []):
        typer.echo(f"  line {line_error['line']}: {line_error['code']}: {line_error['message']}", err=True)
    return typer.Exit(1)


def call(fn: Callable[[], T]) -> T:
    """fn(), with an API error printed by `fail` (exit status 1)."""
    from shared.client import FleetApiError

    try:
        return fn()
    except FleetApiError as exc:
        raise fail(exc) from exc
