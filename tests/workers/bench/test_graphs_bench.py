"""`specfleet bench graphs`: refused where no CUDA device is visible; on a GPU, a short run of the real thing."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from workers.bench.graphs_bench import GraphsBenchPlan, bench_graphs_command


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where no CUDA device is visible")
def test_bench_graphs_is_refused_without_a_cuda_device(tmp_path: Path) -> None:
    cli = Path(sys.executable).parent / "specfleet"
    done = subprocess.run(
        [str(cli), "bench", "graphs", "--json", str(tmp_path / "g.json")], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2
    assert "needs a CUDA device" in done.stderr
    assert not (tmp_path / "g.json").exists()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_bench_graphs_quick_writes_its_ratios(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECFLEET_HOME", str(tmp_path / "home"))  # no demo pair there: the tiny pair
    assert bench_graphs_command(quick=True, json_path=str(tmp_path / "g.json")) == 0
    doc = json.loads((tmp_path / "g.json").read_text())
    plan = GraphsBenchPlan.quick()
    assert len(doc["rows"]) == 2 * plan.num_rounds * len(plan.concurrencies)
    assert set(doc["machine"]["capture_s"]) == {"target"}
    for concurrency in plan.concurrencies:
        # bf16: a padded graph's matmuls may round differently from the exact batch's (float64 exactness:
        # tests/workers/engine/test_cuda.py), so the match is reported, not required
        assert 0.0 <= doc["ratios"][f"greedy_match_c{concurrency}"] <= 1.0
        assert doc["ratios"][f"graphs_vs_op_by_op_c{concurrency}"] > 0
