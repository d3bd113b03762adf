"""Fleet commands on the root `specfleet` app: up, gateway, worker, submit, status, stream, cancel.

Heavy imports (torch, uvicorn, redis) happen inside the command functions so `specfleet --help` stays fast.
"""

import json
import os
import sys
from typing import Annotated

import typer

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


def up(
    port: Annotated[
        int | None, typer.Option(help="Gateway port (0 = a free one; default: settings.port)")
    ] = None,
    target: Annotated[str | None, typer.Option(help="Target model dir; default: the demo pair")] = None,
    draft: Annotated[str | None, typer.Option(help="Draft model dir")] = None,
) -> None:
    """Everything in one command: private Redis, demo models (built if missing), one worker, the gateway."""
    from gateway.launcher import Fleet

    raise typer.Exit(Fleet(port=port, target=target, draft=draft).run())


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

    from shared.settings import get_settings

    settings = get_settings()
    uvicorn.run(
        "gateway.main:create_app",  # an import string: each of `workers` processes builds its own app
        factory=True,
        host=host or settings.host,
        port=settings.port if port is None else port,
        workers=workers,
        access_log=access_log,
        log_level="info",
        ws="none",
        timeout_graceful_shutdown=5,
    )


def worker(
    target: Annotated[
        str | None, typer.Option(help="Target model dir; default: engine config (demo pair)")
    ] = None,
    draft: Annotated[str | None, typer.Option(help="Draft model dir")] = None,
    engine_config: Annotated[
        str | None, typer.Option(help="Engine YAML (default: settings.engine_config)")
    ] = None,
    max_num_seqs: Annotated[int | None, typer.Option(help="Most jobs running at once")] = None,
    num_threads: Annotated[int | None, typer.Option(help="torch threads")] = None,
    burst: Annotated[bool, typer.Option("--burst", help="Exit once the queues are empty")] = False,
    name: Annotated[str | None, typer.Option(help="Worker id (default: host-pid-random)")] = None,
) -> None:
    """Pull jobs from Redis and run them on the engine (needs REDIS_URL)."""
    import redis

    from shared.settings import get_settings
    from workers.demo.resolve import with_demo_pair
    from workers.engine.config import EngineConfig
    from workers.engine.engine import Engine
    from workers.worker.main import Worker

    settings = get_settings()
    if settings.redis_url is None:
        typer.echo("error: set REDIS_URL (or use `specfleet up`)", err=True)
        raise typer.Exit(2)
    cfg = EngineConfig.load(
        engine_config or settings.engine_config,
        target_dir=target,
        draft_dir=draft,
        max_num_seqs=max_num_seqs,
        num_threads=num_threads,
    )
    engine = Engine.from_config(with_demo_pair(cfg))
    metrics = None
    if settings.worker_metrics_port:
        from workers.worker.engine_metrics import EngineMetrics

        metrics = EngineMetrics()
        metrics.serve(settings.host, settings.worker_metrics_port)
    client = redis.Redis.from_url(settings.redis_url, decode_responses=True, health_check_interval=30)
    Worker(
        engine, client, settings, worker_id=name, burst=burst, model_name=target or "demo", metrics=metrics
    ).run()
    client.close()


def submit(
    prompt: Annotated[str, typer.Argument(help="Prompt text")],
    max_tokens: Annotated[int, typer.Option()] = 128,
    temperature: Annotated[float, typer.Option(help="0 = greedy")] = 0.0,
    priority: Annotated[str, typer.Option(help="interactive | default | batch")] = "default",
    speculative: Annotated[str | None, typer.Option(help="none | draft | ngram")] = None,
    idempotency_key: Annotated[str | None, typer.Option()] = None,
    stream: Annotated[
        bool, typer.Option("--stream", help="Stream the text instead of printing the job id")
    ] = False,
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
    with FleetClient(gateway_url(url)) as client:
        job = call(lambda: client.submit(body, idempotency_key=idempotency_key))
        if not stream:
            typer.echo(job["id"])
            return
        _print_stream(client, job["id"], None)


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
        _print_stream(client, job_id, last_event_id)


def cancel(job_id: str, url: UrlOpt = None) -> None:
    """Cancel a queued or running job."""
    from shared.client import FleetClient

    with FleetClient(gateway_url(url)) as client:
        typer.echo(call(lambda: client.cancel(job_id))["status"])


def fail(exc: Exception) -> typer.Exit:
    """Print an API error (and each bad line of a refused batch) on stderr; the Exit to raise."""
    typer.echo(f"error: {exc}", err=True)
    body = getattr(exc, "body", None)
    for line_error in (body or {}).get("error", {}).get("data", []):
        typer.echo(f"  line {line_error['line']}: {line_error['code']}: {line_error['message']}", err=True)
    return typer.Exit(1)


def call(fn):  # type: ignore[no-untyped-def]  # noqa: ANN001, ANN201
    """fn(), with an API error printed by `fail` (exit status 1)."""
    from shared.client import FleetApiError

    try:
        return fn()
    except FleetApiError as exc:
        raise fail(exc) from exc


def _print_stream(client, job_id: str, last_event_id: str | None) -> None:  # type: ignore[no-untyped-def]  # noqa: ANN001
    def run() -> None:
        for event in client.stream(job_id, last_event_id):
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
    for command in (up, gateway, worker, submit, status, stream, cancel):
        app.command()(command)
    from gateway import keys_cli

    keys_cli.register(app)
