"""`specfleet bench report` on the smallest real run: the tiny random pair through the real engine, spec and e2e
benchmarks (tiny plans), then the real report: Markdown, PNG figures, each bench's JSON, the combined JSON."""

import json
import struct
import subprocess
import sys
from pathlib import Path

from tests.helpers import REPO_ROOT
from workers.bench.e2e_bench import E2EBenchPlan
from workers.bench.engine_bench import EngineBenchPlan
from workers.bench.full_report import FIGURES, ReportPlan, combined_json, run_benches, write_report
from workers.bench.spec_bench import SpecBenchPlan
from workers.engine.config import EngineConfig

TINY = ReportPlan(
    EngineBenchPlan(num_new_tokens=8, num_bs1_prompts=2, concurrencies=(2,)),
    SpecBenchPlan(num_new_tokens=8, num_bs1_prompts=2, batch_sizes=(1, 2), tree_size=3, json_batch_sizes=(1, 2),
                  num_json_sampled_runs=4),
    E2EBenchPlan.tiny(),
)
PROMPTS = ["def parse(argv):\n    ", "class Reader:\n    def __init__(self", "import os\n\nfor name in"]


def png_size(path: Path) -> tuple[int, int]:
    header = path.read_bytes()[:24]
    assert header[:8] == b"\x89PNG\r\n\x1a\n", path
    return struct.unpack(">II", header[16:24])


def test_report_of_a_tiny_run(tiny_pair: tuple[Path, Path], tmp_path: Path) -> None:
    # fixed k: the tiny draft costs what its target does, so measured lengths would draft nothing at all
    results = run_benches(tiny_pair, PROMPTS, TINY, EngineConfig(num_threads=1, is_adaptive=False))
    meta = {"date": "2026-01-01", "commit": "abc1234", "quick": True, "model": "tiny", "new_tokens": 8}
    report = write_report(results, tmp_path / "report", meta)

    text = report.read_text()
    assert text.startswith("# specfleet benchmark report — 2026-01-01, commit abc1234")
    for name in FIGURES.values():
        assert f"]({name})" in text
        width, height = png_size(tmp_path / "report" / name)
        assert width >= 960 and height >= 540  # readable at 120 dpi
    for bench in ("engine", "spec", "e2e"):
        doc = json.loads((tmp_path / "report" / f"{bench}.json").read_text())
        assert doc["bench"] == bench and doc["rows"] and doc["ratios"]
    spec_rows = {(r["system"], r["batch"]): r for r in results["spec"]["rows"]}
    per_position = spec_rows[("sd_draft_chain", 1)]["acceptance_per_position"]
    assert per_position and all(0.0 <= rate <= 1.0 and drafted >= 1 for rate, drafted in per_position)
    assert per_position[0][1] >= per_position[-1][1]  # every draft reaching a depth passed the ones before
    assert spec_rows[("plain", 1)]["acceptance_per_position"] == []  # plain decoding drafts nothing
    assert "| fleet | 2 |" in text  # the e2e latency table
    combined = combined_json(results, meta)
    assert combined["bench"] == "report" and {r["bench"] for r in combined["rows"]} == {"engine", "spec", "e2e"}
    assert "sd_vs_plain_bs1" in combined["ratios"] and "fleet_ttft_overhead_ms_p50" in combined["ratios"]
    # speculation under a JSON schema: constrained greedy output equals constrained plain decoding
    assert combined["ratios"]["json_schema_min_greedy_match_vs_plain"] == 1.0
    assert combined["ratios"]["json_schema_sampled_valid"] == 1.0 and "json_schema_draft_chain_vs_plain_bs1" in combined["ratios"]


def test_report_options_are_checked() -> None:
    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "shared.cli", "bench", *args], cwd=REPO_ROOT,
                              capture_output=True, text=True, timeout=60)

    wrong = cli("spec", "--out", "x")
    assert wrong.returncode == 2 and "--out is an option of the report only" in wrong.stderr
    wrong = cli("engine", "--work-dir", "x")
    assert wrong.returncode == 2 and "--work-dir is an option of the e2e benchmark only" in wrong.stderr
    assert "report" in cli("--help").stdout or "report" in cli("nope").stderr
