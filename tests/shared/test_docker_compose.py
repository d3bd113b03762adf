"""docker-compose.yml cannot run here (no Docker): parse it, then start each service's command directly."""

import os
import shlex
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis
import yaml

from shared.redis_server import find_redis_server, free_port
from shared.settings import ServiceSettings
from tests.helpers.redis_fixtures import create_key
from tests.helpers.waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def _env_file(compose: dict) -> dict[str, str]:
    path = ROOT / compose["services"]["gateway"]["env_file"]
    pairs = [
        line.split("=", 1) for line in path.read_text().splitlines() if line and not line.startswith("#")
    ]
    return {k: v for k, v in pairs}


def _local(command: list[str]) -> list[str]:
    """A service command as this machine runs it: `specfleet` is `python -m shared.cli` here."""
    if command[0] == "specfleet":
        return [sys.executable, "-m", "shared.cli", *command[1:]]
    if command[0] == "python":
        return [sys.executable, *command[1:]]
    return command


def test_services_volumes_and_health_checks(compose: dict) -> None:
    services = compose["services"]
    assert set(services) == {"redis", "gateway", "worker", "tasks"}
    redis_cmd = services["redis"]["command"]
    assert redis_cmd[redis_cmd.index("--appendonly") + 1] == "yes"
    assert "redis-data:/data" in services["redis"]["volumes"] and "redis-data" in compose["volumes"]
    for name in services:
        assert services[name]["healthcheck"]["test"][0] in ("CMD", "CMD-SHELL"), name
    for name in ("gateway", "worker", "tasks"):
        assert services[name]["depends_on"]["redis"]["condition"] == "service_healthy"
        assert services[name]["command"][:2] == ["specfleet", name]
    assert services["gateway"]["ports"] == ["8000:8000"]
    env = _env_file(compose)
    assert env["REDIS_URL"] == "redis://redis:6379/0"
    defaults = ServiceSettings.model_fields
    assert int(env.get("SPECFLEET_PORT", defaults["port"].default)) == 8000  # the published container port
    grace_s = float(env.get("SPECFLEET_SHUTDOWN_GRACE_S", defaults["shutdown_grace_s"].default))
    assert grace_s < int(services["worker"]["stop_grace_period"].removesuffix("s"))  # hand back before the kill
    assert (ROOT / services["gateway"]["build"] / "Dockerfile").exists()


@pytest.fixture
def compose_redis(compose: dict, tmp_path: Path) -> Iterator[str]:
    """The redis service's command, run with this machine's redis-server on a free port."""
    port = free_port()
    command = [find_redis_server(), *compose["services"]["redis"]["command"][1:]]
    command[command.index("--dir") + 1] = str(tmp_path)
    proc = subprocess.Popen([*command, "--port", str(port)], stdout=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    client = redis.Redis.from_url(url)
    try:
        wait_until(lambda: _pings(client), what="the redis service")
        assert client.config_get("appendonly") == {"appendonly": "yes"}
        yield url
    finally:
        client.close()
        proc.terminate()
        proc.wait(timeout=10)


def _pings(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.ConnectionError:
        return False


def _healthy(service: dict, env: dict[str, str]) -> bool:
    kind, *command = service["healthcheck"]["test"]
    args = _local(command) if kind == "CMD" else ["sh", "-c", shlex.join(command)]
    return subprocess.run(args, env=env, cwd=ROOT, capture_output=True, timeout=30).returncode == 0


def test_each_service_command_starts(
    compose: dict, compose_redis: str, tiny_pair: tuple[Path, Path], tmp_path: Path
) -> None:
    services = compose["services"]
    port = free_port()
    env = {
        **os.environ,
        **_env_file(compose),
        "REDIS_URL": compose_redis,
        "SPECFLEET_PORT": str(port),
        "SPECFLEET_ENGINE_TARGET_DIR": str(tiny_pair[0]),
        "SPECFLEET_ENGINE_DRAFT_DIR": str(tiny_pair[1]),
        "SPECFLEET_HEARTBEAT_INTERVAL_S": "0.5",
    }
    procs = {}
    for name in ("worker", "gateway"):
        with open(tmp_path / f"{name}.log", "wb") as log:
            procs[name] = subprocess.Popen(
                _local(services[name]["command"]), env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT
            )
    try:
        assert not _healthy(services["worker"], {**env, "REDIS_URL": "redis://127.0.0.1:1/0"})
        wait_until(
            lambda: _healthy(services["gateway"], env), timeout_s=60, interval_s=0.2, what="gateway health"
        )
        wait_until(
            lambda: _healthy(services["worker"], env), timeout_s=120, interval_s=0.2, what="worker health"
        )
        secret = create_key(compose_redis)[1]  # an operator's `specfleet keys create`
        job = httpx.post(
            f"http://127.0.0.1:{port}/v1/jobs",
            headers={"Prefer": "wait=60", "Authorization": f"Bearer {secret}"},
            json={"prompt": "def f(x):", "max_tokens": 8, "temperature": 0},
            timeout=90,
        ).json()
        assert job["status"] == "succeeded" and len(job["output"]["token_ids"]) == 8
    finally:
        for proc in procs.values():
            proc.terminate()
        codes = {name: proc.wait(timeout=30) for name, proc in procs.items()}
    # uvicorn shuts down gracefully, then re-raises the SIGTERM it caught (so supervisors see the signal)
    assert codes == {"worker": 0, "gateway": -signal.SIGTERM}
    assert "Application shutdown complete" in (tmp_path / "gateway.log").read_text()
