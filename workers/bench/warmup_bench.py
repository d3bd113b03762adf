"""`specfleet bench warmup [--quick] [--json PATH]`: the first job's TTFT after start-up against the steady
state, without and with the worker's warm-up (workers/worker/warmup.py), on the demo pair.

Each mode runs in a fresh process (a process that already ran an engine is warm whatever the engine does):
build the engine (`compile: auto`, or `off` with --quick, which skips the minute of compilation), run the
warm-up or not, then one request (the first job), then `num_steady` more of the same prompt one after another;
the ratio is the first job's TTFT over the median of the rest. The issue's goal: ≤ 1.5 with warm-up.
"""

import json
import statistics
import subprocess
import sys
import time
from typing import Any

import typer

from workers.bench.report import format_table, machine_info, write_json

MODES = ("cold", "warm")
NEW_TOKENS = 16


def _ttft_ms(engine: Any, request_id: str, prompt: str) -> float:
    from workers.engine.sampling_params import SamplingParams

    engine.add_request(request_id, prompt, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0))
    while True:
        for out in engine.step():
            if out.finished and out.request_id == request_id:
                return float(out.metrics["ttft_ms"])


def measure(mode: str, compile_mode: str, num_steady: int) -> dict[str, Any]:
    """One mode, in this process: start-up, warm-up (mode warm), the first job, then the steady ones."""
    from workers.demo.corpus import held_out_prompts
    from workers.demo.resolve import with_demo_pair
    from workers.engine.config import EngineConfig
    from workers.engine.engine import Engine
    from workers.worker.warmup import warm_up

    prompt = held_out_prompts(1)[0]
    start_s = time.perf_counter()
    engine = Engine.from_config(with_demo_pair(EngineConfig.load(compile=compile_mode)))
    start_up_s = time.perf_counter() - start_s
    warmup_s = warm_up(engine).duration_s if mode == "warm" else 0.0
    first = _ttft_ms(engine, "first", prompt)
    steady = [_ttft_ms(engine, f"steady-{i}", prompt) for i in range(num_steady)]
    steady_p50 = statistics.median(steady)
    return {
        "mode": mode,
        "compile": compile_mode,
        "start_up_s": round(start_up_s, 2),
        "warmup_s": round(warmup_s, 2),
        "first_ttft_ms": round(first, 2),
        "steady_ttft_ms_p50": round(steady_p50, 2),
        "first_vs_steady": round(first / steady_p50, 3),
        "num_steady": num_steady,
    }


def bench_warmup(quick: bool) -> dict[str, Any]:
    compile_mode, num_steady = ("off", 8) if quick else ("auto", 16)
    rows = []
    for mode in MODES:
        proc = subprocess.run(
            [sys.executable, "-m", "workers.bench.warmup_bench", mode, compile_mode, str(num_steady)],
            capture_output=True, text=True, check=True,
        )
        rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    by_mode = {row["mode"]: row for row in rows}
    ratios = {
        "warm_first_vs_steady_ttft": by_mode["warm"]["first_vs_steady"],
        "cold_first_vs_steady_ttft": by_mode["cold"]["first_vs_steady"],
    }
    return {"rows": rows, "ratios": ratios, "compile": compile_mode}


def bench_warmup_command(quick: bool, json_path: str | None) -> int:
    result = bench_warmup(quick)
    columns = ["mode", "compile", "start_up_s", "warmup_s", "first_ttft_ms", "steady_ttft_ms_p50", "first_vs_steady"]
    typer.echo(format_table(result["rows"], columns))
    for key, value in result["ratios"].items():
        typer.echo(f"{key}: {value:.2f}")
    if json_path:
        write_json(json_path, "warmup", machine_info(quick=quick, compile=result["compile"]), result["rows"],
                   result["ratios"])
    return 0


if __name__ == "__main__":
    print(json.dumps(measure(sys.argv[1], sys.argv[2], int(sys.argv[3]))))  # noqa: T201  (read by bench_warmup)
