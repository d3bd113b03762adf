"""`specfleet bench report`: the engine, spec and e2e benchmarks in one run, written as a Markdown report with
PNG figures (workers/bench/plots.py) and the three benches' JSON beside it.

    <out>/report.md  throughput.png  speculation.png  fleet_ttft.png  engine.json  spec.json  e2e.json

The default folder is docs/bench/<date>-<commit>/ (the README links the latest).
"""

import datetime
import json
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from workers.bench import plots
from workers.bench.e2e_bench import E2EBenchPlan, bench_e2e
from workers.bench.engine_bench import EngineBenchPlan, bench_engine
from workers.bench.report import format_table, machine_info, write_json
from workers.bench.spec_bench import SpecBenchPlan, bench_spec
from workers.engine.config import EngineConfig

ROOT = Path(__file__).resolve().parents[2]
FIGURES = {"throughput": "throughput.png", "speculation": "speculation.png", "fleet_ttft": "fleet_ttft.png"}


@dataclass(frozen=True)
class ReportPlan:
    engine: EngineBenchPlan
    spec: SpecBenchPlan
    e2e: E2EBenchPlan

    @classmethod
    def of(cls, quick: bool) -> "ReportPlan":
        if quick:
            return cls(EngineBenchPlan.quick(), SpecBenchPlan.quick(), E2EBenchPlan.quick())
        return cls(EngineBenchPlan(), SpecBenchPlan(), E2EBenchPlan())


def git_commit() -> str:
    """The short commit of the checkout, `-dirty` when it has uncommitted changes; `unknown` outside git."""
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                text=True, check=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, check=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return f"{commit}-dirty" if dirty else commit


def default_out_dir(today: datetime.date, commit: str) -> Path:
    return ROOT / "docs" / "bench" / f"{today.isoformat()}-{commit}"


def run_benches(pair_dirs: tuple[Path, Path], prompts: list[str], plan: ReportPlan,
                base: EngineConfig, settle_gc: bool = False) -> dict[str, dict[str, Any]]:
    """The three benchmarks, one after another, on one model pair (settle_gc: bench_e2e's)."""
    target_dir, draft_dir = pair_dirs
    return {
        "engine": bench_engine(target_dir, prompts, plan.engine, base),
        "spec": bench_spec(pair_dirs, prompts, plan.spec, base),
        "e2e": bench_e2e(target_dir, draft_dir, plan.e2e, settle_gc=settle_gc),
    }


def write_report(results: dict[str, dict[str, Any]], out_dir: Path, meta: dict[str, Any]) -> Path:
    """report.md, the figures and each bench's JSON (the contract's shape) in out_dir; returns report.md."""
    out_dir.mkdir(parents=True, exist_ok=True)
    plots.throughput(results["spec"], results["engine"], out_dir / FIGURES["throughput"])
    plots.speculation(results["spec"], out_dir / FIGURES["speculation"])
    plots.fleet_ttft(results["e2e"], out_dir / FIGURES["fleet_ttft"])
    for name, result in results.items():
        write_json(out_dir / f"{name}.json", name, machine_info(**meta), result["rows"], result["ratios"])
    path = out_dir / "report.md"
    path.write_text(markdown(results, meta))
    return path


def combined_json(results: dict[str, dict[str, Any]], meta: dict[str, Any]) -> dict[str, Any]:
    """`--json`: the contract's shape; rows carry their bench's name, ratios keep theirs (they are distinct)."""
    rows = [{"bench": name, **row} for name, result in results.items() for row in result["rows"]]
    ratios = {key: value for result in results.values() for key, value in result["ratios"].items()}
    return {"bench": "report", "machine": machine_info(**meta), "rows": rows, "ratios": ratios}


def _table(rows: list[dict[str, Any]], columns: list[str]) -> str:
    def cell(value: Any) -> str:
        return f"{value:.3g}" if isinstance(value, float) else str(value)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(r.get(c, "")) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def _ratios(ratios: dict[str, float]) -> str:
    return "\n".join(f"- `{key}`: {value:.3f}" for key, value in ratios.items())


def _load_line(meta: dict[str, Any], cores: int | None) -> str:
    if "load_avg_1min" not in meta:
        return ""
    start, end = meta["load_avg_1min"]
    busy = " (more than the cores: other work shared the machine, absolute figures are low)" if max(start, end) > (cores or 1) else ""
    return f"Load average (1 min) at the start and end: {start:.1f} / {end:.1f}{busy}."


def markdown(results: dict[str, dict[str, Any]], meta: dict[str, Any]) -> str:
    machine = machine_info(**meta)
    e2e_rows = results["e2e"]["rows"]
    latency = [r for r in e2e_rows if r["phase"] == "latency"]
    return f"""# specfleet benchmark report — {meta['date']}, commit {meta['commit']}

`specfleet bench report{' --quick' if meta['quick'] else ''}` on the {meta['model']} pair: one run of the engine, spec
and e2e benchmarks, one after another on one machine. Compare figures within this run; hosts of one kind
differ by ±20 % between runs (README, "Benchmarks").

Machine: {machine['cpu']}, {machine['cores']} cores, torch {machine['torch']} ({machine['cpu_capability']}),
dtype {results['spec'].get('dtype', '?')}, {meta['new_tokens']} new tokens per request (greedy, EOS ignored).
{_load_line(meta, machine['cores'])}

## Throughput against batch size

![tokens/s against batch size]({FIGURES['throughput']})

The specfleet lines (plain and SD) come from the spec benchmark; transformers' padded batch from the engine
benchmark, run just before it; transformers' assisted generation and prompt lookup run at batch 1 only.

{_table(results['spec']['rows'], ['system', 'batch', 'tokens_per_s', 'tau', 'acceptance_rate', 'match_vs_plain'])}

{_table(results['engine']['rows'], ['system', 'concurrency', 'tokens_per_s', 'greedy_match_vs_hf'])}

## Speculation: τ and acceptance per draft position

![tau and acceptance per position]({FIGURES['speculation']})

τ = tokens emitted per target pass while speculating (accepted drafts + one); acceptance at position i =
the share of the steps whose draft reached depth i that had it accepted (the adaptive speculation length
decides how often a depth is drafted at all; rarely drafted depths are left out of the plot).

## Fleet time to first token

![fleet TTFT]({FIGURES['fleet_ttft']})

{_table(latency, ['system', 'concurrency', 'ttft_ms_p50', 'ttft_ms_p99', 'tpot_ms_p50', 'tokens_per_s', 'num_requests'])}

## Cost per 1,000 tokens

From the jobs' own records (each job's share of engine time), speculation on and off, the same requests:

{_table([r for r in e2e_rows if r["phase"] == "cost"], ['concurrency', 'speculation', 'tokens', 'compute_s_per_1k', 'cost_per_1k'])}

## Headline ratios

Engine:
{_ratios(results['engine']['ratios'])}

Speculative decoding:
{_ratios(results['spec']['ratios'])}

Fleet (e2e):
{_ratios(results['e2e']['ratios'])}

Raw results: [engine.json](engine.json), [spec.json](spec.json), [e2e.json](e2e.json).
"""


def print_summary(results: dict[str, dict[str, Any]]) -> str:
    return format_table(results["spec"]["rows"], ["system", "batch", "tokens_per_s", "tau", "acceptance_rate"])


def write_combined_json(path: str, results: dict[str, dict[str, Any]], meta: dict[str, Any]) -> None:
    Path(path).write_text(json.dumps(combined_json(results, meta), indent=2) + "\n")
