"""`specfleet bench graphs`: plain decoding on a CUDA device with decode graphs (`cuda_graphs: true`) against
the same engine op by op (`cuda_graphs: false`), in one run: rounds interleaved, each round running both engines
over the same prompts at each concurrency; the ratio is the median of the rounds' ratios. Greedy tokens of the
two are compared (`greedy_match`).

The demo pair when it is built (`SPECFLEET_HOME`), else the tiny random pair built into a temporary folder. Where
typer is not installed (a bare GPU machine): `python3 -m workers.bench.graphs_bench [--quick] [--json PATH]`.
"""

import argparse
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from shared.speculation import SpeculativeMethod
from workers.bench.engine_bench import run_ours
from workers.bench.report import format_table, machine_info, write_json
from workers.engine.config import EngineConfig
from workers.engine.engine import Engine


@dataclass(frozen=True)
class GraphsBenchPlan:
    num_new_tokens: int = 128
    concurrencies: tuple[int, ...] = (1, 8, 32)
    num_rounds: int = 3

    @classmethod
    def quick(cls) -> "GraphsBenchPlan":
        return cls(num_new_tokens=64, concurrencies=(1, 16), num_rounds=2)


def decode(engine: Engine, prompts: list[list[int]], num_new: int) -> tuple[float, list[list[int]]]:
    """Every prompt at once, greedy, EOS ignored (engine_bench.run_ours): (tokens/s, the tokens of each)."""
    seconds, generated = run_ours(engine, prompts, num_new)
    return num_new * len(prompts) / seconds, generated


def bench_graphs(target_dir: Path, prompts: list[list[int]], plan: GraphsBenchPlan) -> dict[str, Any]:
    start_s = {}
    engines = {}
    for name, is_graphed in (("graphs", True), ("op_by_op", False)):
        begin = time.perf_counter()
        cfg = EngineConfig(
            target_dir=str(target_dir), device="cuda", cuda_graphs=is_graphed,
            speculative_method=SpeculativeMethod.NONE, kv_cache_mb=2048.0, max_num_seqs=max(plan.concurrencies),
        )
        engines[name] = Engine.from_config(cfg)
        start_s[name] = time.perf_counter() - begin
    rows: list[dict[str, Any]] = []
    ratios: dict[str, float] = {}
    for concurrency in plan.concurrencies:
        batch = [prompts[i % len(prompts)] for i in range(concurrency)]
        for engine in engines.values():
            decode(engine, batch, 8)  # warm this batch's shapes
        per_round: list[float] = []
        outputs: dict[str, list[list[int]]] = {}
        for round_index in range(plan.num_rounds):
            rates = {}
            for name, engine in engines.items():
                rates[name], outputs[name] = decode(engine, batch, plan.num_new_tokens)
                rows.append({"engine": name, "concurrency": concurrency, "round": round_index,
                             "tokens_per_s": rates[name]})
            per_round.append(rates["graphs"] / rates["op_by_op"])
        ratios[f"graphs_vs_op_by_op_c{concurrency}"] = statistics.median(per_round)
        matches = [a == b for a, b in zip(outputs["graphs"], outputs["op_by_op"], strict=True)]
        ratios[f"greedy_match_c{concurrency}"] = sum(matches) / len(matches)
    graphed = engines["graphs"]
    return {
        "rows": rows,
        "ratios": ratios,
        "dtype": str(graphed.runner.model.embed.weight.dtype).removeprefix("torch."),
        "device": torch.cuda.get_device_name(graphed.device),
        "start_up_s": start_s,
        "capture_s": graphed.graph_capture_s,
    }


def bench_graphs_command(quick: bool, json_path: str | None) -> int:
    if not torch.cuda.is_available():
        sys.stderr.write("error: bench graphs needs a CUDA device (this torch build sees none)\n")
        return 2
    plan = GraphsBenchPlan.quick() if quick else GraphsBenchPlan()
    with tempfile.TemporaryDirectory() as scratch:
        target_dir, prompts, model = _models(Path(scratch))
        result = bench_graphs(target_dir, prompts, plan)
    lines = [format_table(result["rows"], ["engine", "concurrency", "round", "tokens_per_s"]), ""]
    lines.append(f"{model} target on {result['device']} ({result['dtype']}); start-up s {result['start_up_s']}; "
                 f"graph capture s {result['capture_s']}")
    lines += [f"{key}: {value:.2f}" for key, value in result["ratios"].items()]
    sys.stdout.write("\n".join(lines) + "\n")  # typer may be absent (a bare GPU machine): no typer.echo
    if json_path:
        machine = machine_info(gpu=result["device"], dtype=result["dtype"], model=model, quick=quick,
                               start_up_s=result["start_up_s"], capture_s=result["capture_s"])
        write_json(json_path, "graphs", machine, result["rows"], result["ratios"])
    return 0


def _models(scratch: Path) -> tuple[Path, list[list[int]], str]:
    """(target dir, prompts as token ids, which model): the demo target when built, else the tiny one."""
    from workers.demo.build import find_demo_pair
    from workers.demo.corpus import held_out_prompts
    from workers.models.loader import load_tokenizer

    pair = find_demo_pair()
    if pair is not None:
        tokenizer = load_tokenizer(pair.target_dir)
        return pair.target_dir, [tokenizer.encode(p) for p in held_out_prompts(8)], "demo"
    from workers.demo.tiny import make_tiny_pair

    target_dir, _ = make_tiny_pair(scratch / "tiny")
    gen = torch.Generator().manual_seed(0)
    return target_dir, [torch.randint(1, 400, (16 + 8 * i,), generator=gen).tolist() for i in range(8)], "tiny"


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", dest="json_path")
    args = parser.parse_args()
    sys.exit(bench_graphs_command(args.quick, args.json_path))
