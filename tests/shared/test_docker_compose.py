"""docker-compose.yml cannot run here (no Docker): parse it, then start each service's command directly."""

import os
import shlex
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis
import yaml

from shared.api_keys import new_webhook_secret
from shared.redis_server import distinct_free_ports, find_redis_server, free_port
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
    assert set(services) == {"redis", "gateway", "worker", "tasks", "prometheus", "grafana"}
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
    assert env["SPECFLEET_ENV"] == "prod"  # compose is a deployment
    assert "SPECFLEET_WEBHOOK_SECRET" not in env  # the secret comes from the environment:
    assert services["gateway"]["environment"]["SPECFLEET_WEBHOOK_SECRET"].startswith("${SPECFLEET_WEBHOOK_SECRET:?")


def test_prometheus_and_grafana_read_the_repositorys_configs(compose: dict) -> None:
    services, env = compose["services"], _env_file(compose)
    prometheus = services["prometheus"]
    assert "./configs/prometheus:/etc/prometheus:ro" in prometheus["volumes"]
    assert "--config.file=/etc/prometheus/prometheus.yml" in prometheus["command"]
    assert prometheus["secrets"] == ["gateway_metrics_key"] and "gateway_metrics_key" in compose["secrets"]
    config = yaml.safe_load((ROOT / "configs/prometheus/prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert jobs["gateway"]["static_configs"][0]["targets"] == [f"gateway:{ServiceSettings.model_fields['port'].default}"]
    assert jobs["gateway"]["authorization"]["credentials_file"] == "/run/secrets/gateway_metrics_key"
    assert jobs["worker"]["dns_sd_configs"][0]["names"] == ["worker"]  # every scaled worker container
    assert jobs["worker"]["dns_sd_configs"][0]["port"] == int(env["SPECFLEET_WORKER_METRICS_PORT"])
    assert jobs["tasks"]["static_configs"][0]["targets"] == [f"tasks:{env['SPECFLEET_TASKS_METRICS_PORT']}"]
    assert env["SPECFLEET_HOST"] == "0.0.0.0"  # metrics ports reachable from the prometheus container
    assert config["rule_files"] == ["/etc/prometheus/alerts.yml"]
    grafana = services["grafana"]
    assert "./configs/grafana/provisioning:/etc/grafana/provisioning:ro" in grafana["volumes"]
    assert "./configs/grafana/dashboards:/var/lib/grafana/dashboards:ro" in grafana["volumes"]
    provider = yaml.safe_load((ROOT / "configs/grafana/provisioning/dashboards/specfleet.yml").read_text())
    assert provider["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards"
    datasource = yaml.safe_load((ROOT / "configs/grafana/provisioning/datasources/prometheus.yml").read_text())
    assert datasource["datasources"][0]["url"] == "http://prometheus:9090"


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
    """gateway, worker and tasks as compose runs them (prod), each serving its metrics; then the real Prometheus
    with the repository's config (compose's host names pointed at this machine) scrapes all three."""
    services = compose["services"]
    port, worker_metrics, tasks_metrics = distinct_free_ports(3)  # drawn apart, two could be the same
    env = {
        **os.environ,
        **_env_file(compose),
        "REDIS_URL": compose_redis,
        "SPECFLEET_WEBHOOK_SECRET": new_webhook_secret(),  # compose passes it from the environment
        "SPECFLEET_HOST": "127.0.0.1",
        "SPECFLEET_PORT": str(port),
        "SPECFLEET_WORKER_METRICS_PORT": str(worker_metrics),
        "SPECFLEET_TASKS_METRICS_PORT": str(tasks_metrics),
        "SPECFLEET_ENGINE_TARGET_DIR": str(tiny_pair[0]),
        "SPECFLEET_ENGINE_DRAFT_DIR": str(tiny_pair[1]),
        "SPECFLEET_HEARTBEAT_INTERVAL_S": "0.5",
    }
    assert env["SPECFLEET_ENV"] == "prod"
    secret = create_key(compose_redis, "prometheus", is_admin=True)[1]  # README: prod needs a key first
    procs = {}
    for name in ("worker", "tasks", "gateway"):
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
        job = httpx.post(
            f"http://127.0.0.1:{port}/v1/jobs",
            headers={"Prefer": "wait=60", "Authorization": f"Bearer {secret}"},
            json={"prompt": "def f(x):", "max_tokens": 8, "temperature": 0},
            timeout=90,
        ).json()
        assert job["status"] == "succeeded" and len(job["output"]["token_ids"]) == 8
        targets = {"gateway": port, "worker": worker_metrics, "tasks": tasks_metrics}
        wait_until(lambda: _serves_metrics(tasks_metrics), timeout_s=60, what="the tasks metrics")
        _scraped_by_prometheus(targets, secret, tmp_path)
    finally:
        for proc in procs.values():
            proc.terminate()
        codes = {name: proc.wait(timeout=30) for name, proc in procs.items()}
    # uvicorn shuts down gracefully, then re-raises the SIGTERM it caught (so supervisors see the signal)
    assert codes["worker"] == 0 and codes["gateway"] == -signal.SIGTERM
    assert "Application shutdown complete" in (tmp_path / "gateway.log").read_text()


def _serves_metrics(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def _scraped_by_prometheus(ports: dict[str, int], api_key: str, tmp_path: Path) -> None:
    """configs/prometheus as Prometheus loads it in compose, with service names -> 127.0.0.1:<port>."""
    binary = shutil.which("prometheus")
    if binary is None:
        if os.environ.get("CI") == "true":
            pytest.fail("prometheus is missing: .ci/run installs Debian's prometheus package")
        return  # the services' own metrics were checked above; Prometheus itself is not installed here
    config = yaml.safe_load((ROOT / "configs/prometheus/prometheus.yml").read_text())
    config["global"]["scrape_interval"] = "1s"
    config["rule_files"] = [str(ROOT / "configs/prometheus/alerts.yml")]
    for job in config["scrape_configs"]:
        job.pop("dns_sd_configs", None)
        job["static_configs"] = [{"targets": [f"127.0.0.1:{ports[job['job_name']]}"]}]
        if "authorization" in job:
            (tmp_path / "key").write_text(api_key)
            job["authorization"]["credentials_file"] = str(tmp_path / "key")
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    web = f"127.0.0.1:{free_port()}"
    with open(tmp_path / "prometheus.log", "wb") as log:
        proc = subprocess.Popen(
            [binary, f"--config.file={tmp_path / 'prometheus.yml'}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
             f"--web.listen-address={web}"],
            stdout=log, stderr=subprocess.STDOUT,
        )
    try:
        def all_up() -> bool:
            try:
                active = httpx.get(f"http://{web}/api/v1/targets", timeout=2).json()["data"]["activeTargets"]
            except (httpx.TransportError, ValueError):
                return False
            return {t["labels"]["job"]: t["health"] for t in active} == {job: "up" for job in ports}

        wait_until(all_up, timeout_s=60, interval_s=0.2, what="Prometheus to scrape gateway, worker and tasks")
        query = httpx.get(f"http://{web}/api/v1/query", params={"query": "specfleet_workers_alive"}, timeout=5)
        assert float(query.json()["data"]["result"][0]["value"][1]) >= 1
        groups = httpx.get(f"http://{web}/api/v1/rules", timeout=5).json()["data"]["groups"]
        assert sum(len(group["rules"]) for group in groups) == 9  # alerts.yml loaded
    finally:
        proc.terminate()
        proc.wait(timeout=30)
