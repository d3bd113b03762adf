"""What the HTTP commands (jobs, batch) share: the --url option, the gateway URL, API errors on stderr."""

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated, TypeVar

import typer

if TYPE_CHECKING:
    import httpx

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
    """fn(), with an API error printed by `fail`, or a gateway that did not answer said so (exit status 1)."""
    import httpx

    from shared.client import FleetApiError

    try:
        return fn()
    except FleetApiError as exc:
        raise fail(exc) from exc
    except httpx.TransportError as exc:  # not reached, or the connection broke: no traceback, what and where
        typer.echo(f"error: the gateway{_address(exc)} did not answer ({type(exc).__name__}: {exc}); is it "
                   "running? --url or $SPECFLEET_URL names it", err=True)  # fmt: skip
        raise typer.Exit(1) from exc


def _address(exc: "httpx.TransportError") -> str:
    """` at scheme://host:port` of the request that failed ('' where httpx made the error without one)."""
    try:
        url = exc.request.url
    except RuntimeError:  # httpx's `request` raises when it was not set
        return ""
    return f" at {url.scheme}://{url.netloc.decode()}"
