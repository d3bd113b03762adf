"""The monitoring stack's files (configs/prometheus, configs/grafana): the rules load and behave
(`promtool check rules`, `promtool test rules`), the Prometheus config loads (`promtool check config`), and every
metric the dashboard and the rules query is one the code exports (read from the registries themselves).

promtool comes with Debian's `prometheus` package, which .ci/run installs: in CI (CI=true) a missing promtool
fails these tests; elsewhere they are skipped."""

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from prometheus_client import REGISTRY, CollectorRegistry

import workers.tasks.metrics  # noqa: F401  (registers the Celery worker's metrics in the default registry)
from gateway import metrics as gateway_metrics  # noqa: F401  (registers the gateway's)
from workers.worker.engine_metrics import EngineMetrics

ROOT = Path(__file__).resolve().parents[2]
PROMETHEUS = ROOT / "configs" / "prometheus"
DASHBOARD = ROOT / "configs" / "grafana" / "dashboards" / "specfleet.json"
# metric names in PromQL: ours, and the process collector's (the worker exports process_* too)
METRIC_NAME = re.compile(r"\b(?:specfleet|process)_[a-z0-9_]+\b")
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "summary": ("_sum", "_count")}


def promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        if os.environ.get("CI") == "true":
            pytest.fail("promtool is missing: .ci/run installs Debian's prometheus package")
        pytest.skip("promtool is not installed (apt-get install prometheus)")
    return found


def run_promtool(*args: str, cwd: Path = ROOT) -> None:
    proc = subprocess.run([promtool(), *args], cwd=cwd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_rules_load() -> None:
    run_promtool("check", "rules", str(PROMETHEUS / "alerts.yml"))


def test_rules_fire_when_they_should() -> None:
    run_promtool("test", "rules", str(ROOT / "tests" / "configs" / "alerts_test.yml"))


def test_prometheus_config_loads(tmp_path: Path) -> None:
    """The config as Prometheus reads it in its container, with the container paths moved under tmp_path."""
    (tmp_path / "gateway_metrics_key").write_text("sf-placeholder\n")
    shutil.copy(PROMETHEUS / "alerts.yml", tmp_path / "alerts.yml")
    text = (PROMETHEUS / "prometheus.yml").read_text()
    text = text.replace("/etc/prometheus/", f"{tmp_path}/").replace("/run/secrets/", f"{tmp_path}/")
    (tmp_path / "prometheus.yml").write_text(text)
    run_promtool("check", "config", str(tmp_path / "prometheus.yml"))


def exported_names() -> set[str]:
    """Every sample name the code exports: the default registry (gateway, Celery worker) and a worker's
    EngineMetrics registry, each family expanded by its type's suffixes."""
    names = set()
    registries: list[CollectorRegistry] = [REGISTRY, EngineMetrics().registry]
    for registry in registries:
        for family in registry.collect():
            # a counter or histogram is exposed only with its suffixes (no bare `specfleet_jobs_submitted`)
            names.update(family.name + suffix for suffix in SUFFIXES.get(family.type, ("",)))
    return names


def rule_expressions() -> list[str]:
    groups = yaml.safe_load((PROMETHEUS / "alerts.yml").read_text())["groups"]
    return [rule["expr"] for group in groups for rule in group["rules"]]


def dashboard_expressions() -> list[str]:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [target["expr"] for panel in panels for target in panel["targets"]]


def test_every_queried_metric_is_exported() -> None:
    exported = exported_names()
    queried = {name for expr in rule_expressions() + dashboard_expressions() for name in METRIC_NAME.findall(expr)}
    assert queried, "no metric found in the queries"
    assert sorted(queried - exported) == []


def test_the_check_catches_an_unknown_metric() -> None:
    exported = exported_names()
    assert {"specfleet_jobs_submitted_total", "specfleet_engine_ttft_seconds_bucket", "specfleet_queue_depth",
            "specfleet_spec_accepted_tokens_total", "specfleet_webhook_deliveries_total"} <= exported
    # names a query could get wrong: a counter without _total, a histogram without _bucket, a typo
    assert {"specfleet_jobs_submitted", "specfleet_engine_ttft_seconds", "specfleet_queue_dept"} & exported == set()
    assert METRIC_NAME.findall('sum(rate(specfleet_x_total{code=~"5.."}[5m])) / process_open_fds') == [
        "specfleet_x_total", "process_open_fds"
    ]


def test_dashboard_has_the_panels_the_operators_watch() -> None:
    titles = [panel["title"] for panel in json.loads(DASHBOARD.read_text())["panels"]]
    for needed in ("Throughput", "Time to first token", "Time per output token", "Queue depth per priority",
                   "Oldest waiting job per priority", "τ", "Acceptance per draft position", "KV cache usage, prefix cache hit rate",
                   "Errors", "Webhook failures", "Preemptions per priority", "Queue wait and TTFT p99 per priority",
                   "Garbage collector pauses"):
        assert any(title.startswith(needed) for title in titles), needed
    datasource = yaml.safe_load((ROOT / "configs/grafana/provisioning/datasources/prometheus.yml").read_text())
    uid = datasource["datasources"][0]["uid"]
    assert {p["datasource"]["uid"] for p in json.loads(DASHBOARD.read_text())["panels"]} == {uid}
