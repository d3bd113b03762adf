"""`specfleet gateway --workers 2`: two real processes on one port, real HTTP. Each process counts the submits
it served (prometheus-client's multiprocess files, one per process), and every scrape, whichever process
answers it, reports the sum: one consistent set of counters."""

import gc
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.mmap_dict import MmapedDict
from prometheus_client.parser import text_string_to_metric_families

from gateway.main import FULL_COLLECTION_EVERY
from shared.redis_server import free_port
from tests.helpers import REPO_ROOT
from tests.helpers.redis_fixtures import create_key
from tests.helpers.waiting import wait_until

SUBMITTED = "specfleet_jobs_submitted_total"


@pytest.fixture
def two_process_gateway(redis_url: str, tmp_path: Path) -> Iterator[tuple[str, str, Path]]:
    """-> (base URL, admin key, the processes' shared metrics directory)"""
    port = free_port()
    metrics_dir = tmp_path / "metrics"
    metrics_dir.mkdir()
    (metrics_dir / "counter_1.db").write_bytes(b"stale")  # a previous run's file: removed at start
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECFLEET_")}
    env.update({"REDIS_URL": redis_url, "PROMETHEUS_MULTIPROC_DIR": str(metrics_dir)})
    args = [sys.executable, "-m", "shared.cli", "gateway", "--workers", "2", "--port", str(port), "--no-access-log"]
    with open(tmp_path / "gateway.log", "wb") as log:
        proc = subprocess.Popen(args, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: proc.poll() is not None or _serves(url), timeout_s=60, interval_s=0.05,
                   what="the gateway to serve")
        assert proc.poll() is None, (tmp_path / "gateway.log").read_text()
        yield url, create_key(redis_url, "ops", is_admin=True)[1], metrics_dir
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(30)


def _serves(url: str) -> bool:
    try:
        return httpx.get(f"{url}/healthz", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def submits_per_process(metrics_dir: Path) -> dict[str, float]:
    """pid -> submits that process counted, read from its own file."""
    counts = {}
    for path in metrics_dir.glob("counter_*.db"):
        pid = path.stem.removeprefix("counter_")
        counts[pid] = sum(
            value for key, value, _, _ in MmapedDict.read_all_values_from_file(str(path))
            if json.loads(key)[1] == SUBMITTED
        )
    return counts


def scrape_submitted(url: str, secret: str) -> float:
    text = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {secret}"}, timeout=10).text
    return sum(
        sample.value for family in text_string_to_metric_families(text) for sample in family.samples
        if sample.name == SUBMITTED
    )


def test_two_gateway_processes_report_one_set_of_counters(
    two_process_gateway: tuple[str, str, Path],
) -> None:
    url, secret, metrics_dir = two_process_gateway
    assert not (metrics_dir / "counter_1.db").exists()
    num_submitted = 0

    def submit_until_both_processes_served() -> bool:
        nonlocal num_submitted
        for _ in range(4):  # a new connection each: the kernel hands them to either process
            response = httpx.post(f"{url}/v1/jobs", headers={"Authorization": f"Bearer {secret}"},
                                  json={"prompt": "def f(x):", "max_tokens": 1}, timeout=10)
            assert response.status_code == 202, response.text
            num_submitted += 1
        return sum(1 for n in submits_per_process(metrics_dir).values() if n > 0) == 2

    wait_until(submit_until_both_processes_served, timeout_s=60, interval_s=0, what="both processes to serve")
    assert sum(submits_per_process(metrics_dir).values()) == num_submitted
    # every scrape, whichever process answers it, sees all of them
    assert [scrape_submitted(url, secret) for _ in range(6)] == [num_submitted] * 6
    # each process settled its collector once serving (shared/gc_pauses.py) and timed that full collection
    text = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {secret}"}, timeout=10).text
    samples = [sample for family in text_string_to_metric_families(text) for sample in family.samples]
    assert max(s.value for s in samples if s.name == "specfleet_gc_frozen_objects") > 50_000
    thresholds = {s.labels["generation"]: s.value for s in samples if s.name == "specfleet_gc_threshold"}
    assert thresholds["2"] == FULL_COLLECTION_EVERY and thresholds["1"] == gc.get_threshold()[1]
    assert sum(s.value for s in samples
               if s.name == "specfleet_gc_pause_seconds_count" and s.labels["generation"] == "2") >= 2
