"""Commands of this side of the project, registered on the root `specfleet` app (shared/cli.py)."""

import typer


def register(app: typer.Typer) -> None:
    """Add this module's commands to `app`."""
