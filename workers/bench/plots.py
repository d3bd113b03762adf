"""The report's figures (matplotlib, Agg, no pyplot state): one PNG each, written where the caller says.

    throughput(spec, engine)   tokens/s against batch size: plain, SD (chain, tree, n-gram), transformers
    speculation(spec)          tau against batch size, and acceptance per draft position at batch 1
    fleet_ttft(e2e)            time to first token p50/p99, the fleet against the engine in-process
"""

from pathlib import Path
from typing import Any

from matplotlib.axes import Axes
from matplotlib.figure import Figure

DPI = 120
MIN_DRAFTS = 20  # a draft position shown in the acceptance plot was verified at least this often
SD_LABELS = {"sd_draft_chain": "SD: draft chain", "sd_draft_tree": "SD: draft tree", "sd_ngram": "SD: n-gram"}
COLORS = {"plain": "#333333", "sd_draft_chain": "#1f77b4", "sd_draft_tree": "#2ca02c", "sd_ngram": "#ff7f0e",
          "hf": "#d62728", "fleet": "#1f77b4", "engine": "#7f7f7f"}


def _series(rows: list[dict[str, Any]], system: str, x_key: str, y_key: str) -> tuple[list[int], list[float]]:
    points = sorted((r[x_key], r[y_key]) for r in rows if r["system"] == system and y_key in r)
    return [p[0] for p in points], [p[1] for p in points]


def _batch_axis(ax: Axes, batches: list[int]) -> None:
    ax.set_xscale("log", base=2)
    ax.set_xticks(batches, [str(b) for b in batches])
    ax.minorticks_off()
    ax.grid(True, alpha=0.3)


def throughput(spec: dict[str, Any], engine: dict[str, Any], path: Path) -> None:
    fig = Figure(figsize=(10.5, 5), dpi=DPI, layout="constrained")
    ax = fig.subplots()
    spec_rows, engine_rows = spec["rows"], engine["rows"]
    for system, label in (("plain", "specfleet plain"), *SD_LABELS.items()):
        xs, ys = _series(spec_rows, system, "batch", "tokens_per_s")
        ax.plot(xs, ys, marker="o", color=COLORS[system], label=label, linewidth=2 if system == "plain" else 1.5)
    hf_x, hf_y = _series(engine_rows, "hf_generate_padded", "concurrency", "tokens_per_s")
    bs1 = [r["tokens_per_s"] for r in engine_rows if r["system"] == "hf_generate"]
    ax.plot([1, *hf_x], [*bs1, *hf_y], marker="s", linestyle="--", color=COLORS["hf"],
            label="transformers generate (padded batch)")
    for system, marker, label in (("hf_assisted", "^", "transformers assisted (draft), batch 1"),
                                  ("hf_prompt_lookup", "v", "transformers prompt lookup, batch 1")):
        xs, ys = _series(spec_rows, system, "batch", "tokens_per_s")
        ax.scatter(xs, ys, marker=marker, s=70, color=COLORS["hf"], label=label, zorder=3)
    batches = sorted({r["batch"] for r in spec_rows} | {1, *hf_x})
    _batch_axis(ax, batches)
    ax.set_xlabel("batch size (requests decoding at once)")
    ax.set_ylabel("generated tokens/s")
    ax.set_ylim(bottom=0)
    ax.set_title("Throughput against batch size (greedy, demo pair)")
    ax.legend(fontsize=9, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0)
    fig.savefig(path)


def speculation(spec: dict[str, Any], path: Path) -> None:
    fig = Figure(figsize=(11, 4.5), dpi=DPI, layout="constrained")
    tau_ax, pos_ax = fig.subplots(1, 2)
    rows = spec["rows"]
    batches = sorted({r["batch"] for r in rows if r["system"] in SD_LABELS})
    for system, label in SD_LABELS.items():
        xs, ys = _series(rows, system, "batch", "tau")
        tau_ax.plot(xs, ys, marker="o", color=COLORS[system], label=label)
        bs1 = next((r for r in rows if r["system"] == system and r["batch"] == 1), None)
        per_position = bs1.get("acceptance_per_position", []) if bs1 else []
        shown = [(i + 1, rate) for i, (rate, drafted) in enumerate(per_position) if drafted >= MIN_DRAFTS]
        pos_ax.plot([p for p, _ in shown], [r for _, r in shown], marker="o", color=COLORS[system], label=label)
    _batch_axis(tau_ax, batches)
    tau_ax.axhline(1.0, color=COLORS["plain"], linestyle=":", label="plain decoding (1 token per pass)")
    tau_ax.set_xlabel("batch size")
    tau_ax.set_ylabel("τ: tokens per target pass")
    tau_ax.set_ylim(bottom=0)
    tau_ax.set_title("τ against batch size")
    tau_ax.legend(fontsize=8)
    pos_ax.set_xlabel(f"draft position (1 = first drafted token; depths drafted ≥ {MIN_DRAFTS} times)")
    pos_ax.set_ylabel("accepted / drafted at this position")
    pos_ax.set_ylim(0, 1.05)
    pos_ax.xaxis.get_major_locator().set_params(integer=True)
    pos_ax.grid(True, alpha=0.3)
    pos_ax.set_title("Acceptance per draft position (batch 1)")
    pos_ax.legend(fontsize=8)
    fig.savefig(path)


def fleet_ttft(e2e: dict[str, Any], path: Path) -> None:
    fig = Figure(figsize=(10, 4.5), dpi=DPI, layout="constrained")
    axes = fig.subplots(1, 2)
    rows = [r for r in e2e["rows"] if r["phase"] == "latency"]
    concurrencies = sorted({r["concurrency"] for r in rows})
    width = 0.38
    for ax, quantile in zip(axes, ("p50", "p99"), strict=True):
        for offset, system, label in ((-width / 2, "fleet", "fleet (gateway + Redis + worker, SSE)"),
                                      (width / 2, "engine", "engine in-process")):
            values = [next(r[f"ttft_ms_{quantile}"] for r in rows if r["system"] == system and r["concurrency"] == c)
                      for c in concurrencies]
            bars = ax.bar([i + offset for i in range(len(concurrencies))], values, width, color=COLORS[system],
                          label=label)
            ax.bar_label(bars, fmt="%.0f", fontsize=8)
        ax.set_xticks(range(len(concurrencies)), [str(c) for c in concurrencies])
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel("time to first token (ms)")
        ax.set_title(f"TTFT {quantile}")
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=8, loc="upper left")
    fig.savefig(path)
