"""The `specfleet` command: one typer app; each side of the project registers its own commands.

Command modules import heavy libraries (torch, transformers, redis) inside their command functions,
so `specfleet --help` stays fast.
"""

import importlib
import logging

import typer

COMMAND_MODULES = (
    "workers.cli",  # generate, bench
    "workers.demo.cli",  # models build-demo / build-tiny
    "gateway.cli",  # up, gateway, worker, submit, status, stream, cancel
    "gateway.batch_cli",  # batch submit|status|results|cancel|list
    "workers.tasks.cli",  # tasks (the Celery worker)
)

app = typer.Typer(
    no_args_is_help=True, add_completion=False, help="specfleet: speculative-decoding LLM fleet"
)


@app.callback()
def _root() -> None:
    """specfleet: speculative-decoding LLM fleet."""


def _register_all() -> None:
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(app)


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    _register_all()
    app()


if __name__ == "__main__":
    main()
