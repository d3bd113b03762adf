"""The root `specfleet` app: every command group registered in one place; logging set up for the CLI.

Library INFO logs (httpx: one line per request) are off unless `--verbose`; the project's own INFO lines
(the services' progress, a model build's steps) are shown as always.
"""

import logging
from typing import Annotated

import typer

from shared import logs
from shared.cli import batch, bench, dlq, fleet, generate, jobs, keys, load, models, validate

# root-level commands and groups, in `specfleet --help` order
COMMAND_GROUPS = (generate, bench, models, fleet, jobs, keys, batch, dlq, validate, load)
LIBRARY_LOGGERS = ("httpx", "httpcore")

app = typer.Typer(
    no_args_is_help=True, add_completion=False, help="specfleet: speculative-decoding LLM fleet"
)


@app.callback()
def _root(
    verbose: Annotated[
        bool, typer.Option("--verbose", "-v", help="Also show libraries' INFO logs (e.g. every HTTP request)")
    ] = False,
) -> None:
    """specfleet: speculative-decoding LLM fleet."""
    for name in LIBRARY_LOGGERS:
        logging.getLogger(name).setLevel(logging.NOTSET if verbose else logging.WARNING)


def register_all(root: typer.Typer) -> None:
    for group in COMMAND_GROUPS:
        group.register(root)


register_all(app)


def main() -> None:
    logs.configure(json_logs=_log_json())
    app()


def _log_json() -> bool:
    """settings.log_json; text when the settings do not load (the command reports why itself)."""
    from pydantic import ValidationError

    from shared.settings import get_settings

    try:
        return get_settings().log_json
    except ValidationError:
        return False


if __name__ == "__main__":
    main()
