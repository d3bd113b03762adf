"""`specfleet worker` refuses engine settings it cannot start with: exit 2 and the reason, before any Redis call."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[3]


def run_worker(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **(env or {}), "REDIS_URL": "redis://127.0.0.1:1/0"}  # nothing listens there
    return subprocess.run([sys.executable, "-m", "shared.cli", "worker", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120, check=False)  # fmt: skip


def test_a_malformed_device_is_refused_with_its_field(tiny_target: Path) -> None:
    proc = run_worker("--target", str(tiny_target), "--device", "gpu")
    assert proc.returncode == 2, proc.stderr
    assert "device" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU machine starts such a worker (test_cuda.py)")
def test_a_cuda_device_is_refused_where_none_is_visible(tiny_target: Path) -> None:
    proc = run_worker("--target", str(tiny_target), "--device", "cuda")
    assert proc.returncode == 2 and "sees no CUDA device" in proc.stderr, proc.stderr


def test_engine_cpus_outside_the_workers_cores_are_refused(tiny_target: Path) -> None:
    outside = max(os.sched_getaffinity(0)) + 1
    proc = run_worker("--target", str(tiny_target), env={"SPECFLEET_ENGINE_CPUS": str(outside)})
    assert proc.returncode == 2, proc.stderr
    assert "none of them is allowed" in proc.stderr and "Traceback" not in proc.stderr
