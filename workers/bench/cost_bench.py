"""`specfleet bench cost [--quick] [--json PATH]`: cost per 1,000 generated tokens at each concurrency, with
speculation on (the engine's default method) and off, on the demo pair.

The engine runs in-process and each step's time is charged exactly as the worker charges it (workers/worker/
cost.py: split across the step's jobs by scheduled tokens; idle time charged to no one), so `compute_s_per_1k`
is what the job records of a busy worker sum to, and `cost_per_1k` prices it at settings.price_per_worker_hour
(1.0 a worker-hour when that is 0, so the figure reads as "worker-hours' price per 1,000 tokens"). Closed loop:
`concurrency` requests in flight, each new one admitted as one finishes; SD on and off interleaved per level.
"""

import time
from typing import Any

import typer

from workers.bench.report import format_table, machine_info, write_json

NEW_TOKENS = 64


def _run(engine: Any, prompts: list[str], concurrency: int, speculative: bool, price: float) -> dict[str, Any]:
    from shared.speculation import SpeculativeMethod
    from workers.engine.sampling_params import SamplingParams
    from workers.worker.cost import CostMeter, scheduled_tokens

    method = None if speculative else SpeculativeMethod.NONE
    meter = CostMeter(price)
    todo = list(enumerate(prompts))
    in_flight, compute_s, num_tokens = 0, 0.0, 0
    start_s = time.perf_counter()
    while todo or in_flight:
        while todo and in_flight < concurrency:
            i, prompt = todo.pop(0)
            params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, speculative=method)
            engine.add_request(f"{'sd' if speculative else 'plain'}-{concurrency}-{i}", prompt, params)
            in_flight += 1
        step_start_s = time.perf_counter()
        outputs = engine.step()
        meter.account(time.perf_counter() - step_start_s, scheduled_tokens(engine))
        for job_compute_s, _ in meter.finished(outputs):
            compute_s += job_compute_s
        for out in outputs:
            num_tokens += len(out.new_token_ids)
            in_flight -= int(out.finished)
    wall_s = time.perf_counter() - start_s
    return {
        "speculation": "on" if speculative else "off",
        "concurrency": concurrency,
        "tokens": num_tokens,
        "tokens_per_s": round(num_tokens / wall_s, 1),
        "compute_s_per_1k": round(compute_s / num_tokens * 1000, 4),
        "cost_per_1k": meter.cost_of(compute_s) / num_tokens * 1000,
    }


def bench_cost_command(quick: bool, json_path: str | None) -> int:
    from shared.settings import get_settings
    from workers.demo.corpus import held_out_prompts
    from workers.demo.resolve import with_demo_pair
    from workers.engine.config import EngineConfig
    from workers.engine.engine import Engine

    price = get_settings().price_per_worker_hour or 1.0
    concurrencies = (1, 4) if quick else (1, 4, 16)
    engine = Engine.from_config(with_demo_pair(EngineConfig.load()))
    rows = []
    for c in concurrencies:
        prompts = held_out_prompts(max(4, 2 * c))
        for speculative in (True, False):
            rows.append(_run(engine, prompts, c, speculative, price))
    by = {(r["speculation"], r["concurrency"]): r for r in rows}
    ratios = {f"cost_per_1k_sd_vs_plain_c{c}": by[("on", c)]["cost_per_1k"] / by[("off", c)]["cost_per_1k"]
              for c in concurrencies}
    typer.echo(format_table(rows, ["speculation", "concurrency", "tokens", "tokens_per_s", "compute_s_per_1k",
                                   "cost_per_1k"]))
    typer.echo(f"price per worker-hour: {price:g}")
    for key, value in ratios.items():
        typer.echo(f"{key}: {value:.3f}")
    if json_path:
        write_json(json_path, "cost", machine_info(quick=quick, price_per_worker_hour=price,
                                                    new_tokens=NEW_TOKENS), rows, ratios)
    return 0
