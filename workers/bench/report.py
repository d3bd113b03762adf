"""Benchmark output: a printed table and the JSON file of the command-line contract."""

import json
import os
import platform
from pathlib import Path
from typing import Any

import torch


def machine_info(**extra: Any) -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        **extra,
    }


def format_table(rows: list[dict[str, Any]], columns: list[str]) -> str:
    def cell(v: Any) -> str:
        return f"{v:.3f}" if isinstance(v, float) else str(v)

    widths = [max(len(c), *(len(cell(r.get(c, ""))) for r in rows)) for c in columns]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    for r in rows:
        lines.append("  ".join(cell(r.get(c, "")).ljust(w) for c, w in zip(columns, widths, strict=True)))
    return "\n".join(lines)


def write_json(path: str | Path, bench: str, machine: dict, rows: list[dict], ratios: dict[str, float]) -> None:
    doc = {"bench": bench, "machine": machine, "rows": rows, "ratios": ratios}
    Path(path).write_text(json.dumps(doc, indent=2) + "\n")
