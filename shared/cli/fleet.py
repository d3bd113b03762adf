"""`specfleet up|gateway|worker|tasks`: the fleet's long-running services.

`up` runs them all (shared/cli/up.py over the launcher shared/fleet.py); the others are one service each,
as docker-compose.yml runs them. The services log their own INFO lines.
"""

import contextlib
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated

import typer

from shared import cpu_placement
from shared import redis_url as redis_urls
from shared.cli.common import DEMO_MODEL_NAME

log = logging.getLogger(__name__)

MULTIPROC_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"  # read by prometheus-client when it is imported


def up(
    port: Annotated[
        int | None, typer.Option(help="Gateway port (0 = a free one; default: settings.port)")
    ] = None,
    target: Annotated[str | None, typer.Option(help="Target model dir; default: the demo pair")] = None,
    draft: Annotated[str | None, typer.Option(help="Draft model dir")] = None,
    model_version: Annotated[
        str | None, typer.Option(help="The model version the worker serves (default: settings.model_version)")
    ] = None,
) -> None:
    """Everything in one command: private Redis, demo models (built if missing), one worker, the gateway."""
    from shared.cli.up import Up

    try:
        up_ = Up(port=port, target=target, draft=draft, model_version=model_version)
    except ValueError as exc:  # a setting it cannot start with (engine_cpus outside this process's cores)
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
    raise typer.Exit(up_.run())


def gateway(
    host: Annotated[str | None, typer.Option(help="Bind address (default: settings.host)")] = None,
    port: Annotated[int | None, typer.Option(help="Port (default: settings.port)")] = None,
    workers: Annotated[
        int, typer.Option(min=1, help="Gateway processes sharing the port (each has its own pub/sub hub)")
    ] = 1,
    access_log: Annotated[bool, typer.Option(help="Log every request (uvicorn's access log)")] = True,
) -> None:
    """Serve the HTTP API (needs REDIS_URL)."""
    import uvicorn
    from uvicorn.config import LOGGING_CONFIG

    from shared.logs import uvicorn_log_config
    from shared.settings import get_settings

    settings = get_settings()
    log_config = uvicorn_log_config(settings.log_json)
    with _shared_metrics_dir(workers):
        uvicorn.run(
            "gateway.main:create_served_app",  # an import string: each of `workers` processes builds its own app
            factory=True,
            host=host or settings.host,
            port=settings.port if port is None else port,
            workers=workers,
            access_log=access_log,
            log_level="info",
            ws="none",  # http: uvicorn's "auto" serves with httptools, a dependency (README, Dependencies)
            loop="auto",  # uvloop, a dependency, when installed (README, Dependencies)
            timeout_graceful_shutdown=5,
            log_config=log_config or LOGGING_CONFIG,  # uvicorn's own unless JSON logs
        )


@contextlib.contextmanager
def _shared_metrics_dir(num_processes: int) -> Iterator[None]:
    """Several gateway processes: one prometheus-client multiprocess directory for all of them (gateway/metrics.py),
    empty at the start of each run and set before any process imports prometheus-client. PROMETHEUS_MULTIPROC_DIR
    given by the operator is used (its old files removed); otherwise a fresh temporary one, removed afterwards."""
    if num_processes == 1:
        yield
        return
    given = os.environ.get(MULTIPROC_DIR_ENV)
    path = Path(given) if given else Path(tempfile.mkdtemp(prefix="specfleet-gateway-metrics-"))
    path.mkdir(parents=True, exist_ok=True)
    for stale in path.glob("*.db"):
        stale.unlink()
    os.environ[MULTIPROC_DIR_ENV] = str(path)
    try:
        yield
    finally:
        if given is None:
            os.environ.pop(MULTIPROC_DIR_ENV, None)
            shutil.rmtree(path, ignore_errors=True)


def worker(
    target: Annotated[
        str | None, typer.Option(help="Target model dir; default: engine config (demo pair)")
    ] = None,
    draft: Annotated[str | None, typer.Option(help="Draft model dir")] = None,
    eagle: Annotated[str | None, typer.Option(help="EAGLE head dir (for the target)")] = None,
    engine_config: Annotated[
        str | None, typer.Option(help="Engine YAML (default: settings.engine_config)")
    ] = None,
    max_num_seqs: Annotated[int | None, typer.Option(help="Most jobs running at once")] = None,
    num_threads: Annotated[int | None, typer.Option(help="torch threads")] = None,
    tensor_parallel_size: Annotated[
        int | None, typer.Option(help="Shard the target over N ranks (processes) of this worker")
    ] = None,
    device: Annotated[
        str | None, typer.Option(help="auto | cpu | cuda | cuda:N (default: the engine config's, auto)")
    ] = None,
    burst: Annotated[bool, typer.Option("--burst", help="Exit once the queues are empty")] = False,
    name: Annotated[str | None, typer.Option(help="Worker id (default: host-pid-random)")] = None,
    model_version: Annotated[
        str | None,
        typer.Option(help="Serve this model version (default: settings.model_version); jobs may pin it"),
    ] = None,
) -> None:
    """Pull jobs from Redis and run them on the engine (needs REDIS_URL)."""

    from shared import gc_pauses
    from shared.settings import get_settings, with_model_version
    from workers.demo.resolve import with_demo_pair
    from workers.engine.config import EngineConfig
    from workers.engine.engine import Engine
    from workers.engine.tp_group import RankFailedError
    from workers.worker.main import Worker

    settings = get_settings()
    if settings.redis_url is None:
        typer.echo("error: set REDIS_URL (or use `specfleet up`)", err=True)
        raise typer.Exit(2)
    if model_version is not None:
        try:
            settings = with_model_version(settings, model_version)
        except ValueError as exc:
            typer.echo(f"error: --model-version: {exc}", err=True)
            raise typer.Exit(2) from exc
    try:
        placement = cpu_placement.for_worker(settings)
    except ValueError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
    if placement is not None:  # before the engine starts its torch threads: they inherit the main thread's cores
        cpu_placement.bind(placement.engine_cpus)
        log.info("worker cpu placement: %s", placement.describe())
    try:
        cfg = EngineConfig.load(
            engine_config or settings.engine_config,
            target_dir=target,
            draft_dir=draft,
            eagle_dir=eagle,
            max_num_seqs=max_num_seqs,
            num_threads=num_threads,
            tensor_parallel_size=tensor_parallel_size,
            device=device,
        )
        engine = Engine.from_config(with_demo_pair(cfg))
    except ValueError as exc:  # a setting the engine cannot start with (pydantic's errors name the field)
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
    metrics = None
    gc_metrics = None
    if settings.worker_metrics_port:
        from workers.worker.engine_metrics import EngineMetrics

        metrics = EngineMetrics()
        gc_metrics = metrics.gc
        gc_pauses.observe(gc_metrics)
        metrics.serve(settings.host, settings.worker_metrics_port)
    client = redis_urls.client(str(settings.redis_url), decode_responses=True, health_check_interval=30)
    try:
        Worker(
            engine, client, settings, worker_id=name, burst=burst, model_name=target or DEMO_MODEL_NAME, metrics=metrics,
            io_cpus=placement.io_cpus if placement is not None else frozenset(),
            on_started=lambda: gc_pauses.settle(gc_metrics),  # start-up's objects out of later collections
        ).run()
    except RankFailedError as exc:  # the worker handed its jobs back (or they are reclaimed); exit non-zero
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from exc
    finally:
        engine.close()  # the other tensor-parallel ranks, if any
        client.close()


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
    """Add this module's commands to `app`."""
    for command in (up, gateway, worker, tasks):
        app.command()(command)
