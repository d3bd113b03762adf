"""deploy/k8s/: every built-in resource validates offline against the Kubernetes schemas (kubernetes-validate,
strict: an unknown field is an error), and the manifests agree with the code: settings that load, the
graceful hand-back inside the grace period, probes, and KEDA triggers on the real stream and group names."""

from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from shared import keys
from shared.redis_url import parse
from shared.schemas import Priority
from shared.settings import ServiceSettings
from workers.engine.config import EngineConfig

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
KUBERNETES_VERSION = "1.30.0"
CUSTOM_KINDS = {"Kustomization", "ScaledObject"}  # not in the Kubernetes schemas: checked below


def _documents() -> list[tuple[str, dict[str, Any]]]:
    return [
        (path.name, doc)
        for path in sorted(K8S.glob("*.yaml"))
        for doc in yaml.safe_load_all(path.read_text())
        if doc
    ]


def _one(kind: str, name: str) -> dict[str, Any]:
    found = [doc for _, doc in _documents() if doc["kind"] == kind and doc["metadata"]["name"] == name]
    assert len(found) == 1, (kind, name)
    return found[0]


def _container(deployment: str) -> dict[str, Any]:
    return _one("Deployment", deployment)["spec"]["template"]["spec"]["containers"][0]


def test_kustomization_lists_every_manifest() -> None:
    listed = set(yaml.safe_load((K8S / "kustomization.yaml").read_text())["resources"])
    assert listed == {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}


@pytest.mark.parametrize(("name", "doc"), [d for d in _documents() if d[1]["kind"] not in CUSTOM_KINDS],
                         ids=lambda v: v if isinstance(v, str) else f"{v['kind']}/{v['metadata']['name']}")
def test_resources_validate_offline(name: str, doc: dict[str, Any]) -> None:
    kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)  # raises ValidationError naming the field


def test_the_settings_load_as_the_pods_get_them(monkeypatch: pytest.MonkeyPatch) -> None:
    env = {**_one("ConfigMap", "specfleet-settings")["data"], **_one("Secret", "specfleet-secrets")["stringData"]}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    settings = ServiceSettings()  # an unknown SPECFLEET_ field or a bad REDIS_URL fails here
    assert settings.env == "prod" and settings.redis_url is not None
    assert parse(settings.redis_url).topology.value == "sentinel"
    assert settings.claim_timeout_s >= 30  # longer than a Sentinel failover


def test_workers_get_a_gpu_a_grace_period_for_the_hand_back_and_a_disruption_budget(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pod = _one("Deployment", "specfleet-worker")["spec"]["template"]["spec"]
    grace_s = float(_one("ConfigMap", "specfleet-settings")["data"]["SPECFLEET_SHUTDOWN_GRACE_S"])
    assert pod["terminationGracePeriodSeconds"] > grace_s
    resources = pod["containers"][0]["resources"]
    assert resources["requests"]["nvidia.com/gpu"] == resources["limits"]["nvidia.com/gpu"] == 1
    for var in pod["containers"][0]["env"]:
        monkeypatch.setenv(var["name"], var["value"])
    assert EngineConfig.load().device == "cuda"  # the engine on the pod's GPU (SPECFLEET_ENGINE_DEVICE)
    budget = _one("PodDisruptionBudget", "specfleet-worker")["spec"]
    assert budget["selector"] == _one("Deployment", "specfleet-worker")["spec"]["selector"]


def test_probes_use_readyz_and_the_health_checks() -> None:
    gateway = _container("specfleet-gateway")
    assert gateway["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert gateway["livenessProbe"]["httpGet"]["path"] == "/healthz"
    worker = _container("specfleet-worker")
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert worker[probe]["exec"]["command"] == ["python", "-m", "shared.healthcheck", "worker"]
    assert _container("specfleet-tasks")["livenessProbe"]["exec"]["command"][-1] == "workers.tasks.healthcheck"
    hpa = _one("HorizontalPodAutoscaler", "specfleet-gateway")["spec"]
    assert hpa["scaleTargetRef"]["name"] == "specfleet-gateway" and hpa["metrics"][0]["resource"]["name"] == "cpu"
    assert "cpu" in gateway["resources"]["requests"]  # the HPA's utilisation is relative to the request


def test_keda_scales_workers_on_the_lag_of_each_priority_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    scaled = _one("ScaledObject", "specfleet-worker")
    assert scaled["apiVersion"] == "keda.sh/v1alpha1"
    assert scaled["spec"]["scaleTargetRef"]["name"] == "specfleet-worker"
    triggers = scaled["spec"]["triggers"]
    env = {**_one("ConfigMap", "specfleet-settings")["data"], **_one("Secret", "specfleet-secrets")["stringData"]}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    num_partitions = ServiceSettings().redis_partitions  # a trigger per stream of every partition
    streams = {keys.queue_stream(p, n) for n in range(num_partitions) for p in Priority}
    assert {t["metadata"]["stream"] for t in triggers} == streams and len(triggers) == len(streams)
    for trigger in triggers:
        assert trigger["type"] == "redis-sentinel-streams"  # matches the ConfigMap's Sentinel REDIS_URL
        meta = trigger["metadata"]
        assert meta["consumerGroup"] == keys.CONSUMER_GROUP and int(meta["lagCount"]) > 0
        assert meta["sentinelMaster"] == parse(_one("ConfigMap", "specfleet-settings")["data"]["REDIS_URL"]).master_name
