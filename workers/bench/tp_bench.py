"""`specfleet bench tp [--quick] [--json PATH]`: the demo target over two tensor-parallel ranks against one.

For each dtype (the serving dtype, `auto`; and float32 unless --quick) a TP = 1 and a TP = 2 engine are built
on the same settings, both alive for the whole run. Each round runs every held-out prompt at once (continuous
batching), greedy, once with speculation off and once with the draft model, on TP = 1 then TP = 2, so the
host's drift falls on both alike. Figures:

- `tp2_greedy_match`: the fraction of requests whose TP = 2 tokens equal TP = 1's (every dtype, mode, round;
  must be 1.0);
- `tp2_vs_tp1_tokens_per_s`: TP = 2 over TP = 1 throughput, serving dtype, speculation off (a 2-core CPU
  shares its cores between the ranks and pays a gloo all-reduce per layer: no speedup is expected here);
  `tp2_vs_tp1_tokens_per_s_spec` the same with the draft model;
- `tp2_rank_weight_fraction`: the largest rank's resident weight bytes over the unsharded target's (0.5 plus
  the replicated embedding, norms and, on rank 0, the LM head);
- `tp2_max_logit_diff_fp32`: the largest |logit| difference over a ragged prefill of every prompt (float32).
"""

import os
import time
from typing import Any

import typer

from workers.bench.report import format_table, machine_info, write_json

MODES = ("none", "draft")


def _engine(dtype: str, tensor_parallel_size: int) -> Any:
    from workers.demo.resolve import with_demo_pair
    from workers.engine.config import EngineConfig
    from workers.engine.engine import Engine

    cfg = EngineConfig.load(dtype=dtype, tensor_parallel_size=tensor_parallel_size, compile="off")
    return Engine.from_config(with_demo_pair(cfg))


def _run(engine: Any, prompts: list[str], mode: str, max_tokens: int) -> tuple[list[list[int]], int, float]:
    """(each prompt's tokens, tokens generated, seconds) for every prompt at once."""
    from shared.speculation import SpeculativeMethod
    from workers.engine.sampling_params import SamplingParams

    method = SpeculativeMethod(mode)
    params = [SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, speculative=method)
              for _ in prompts]  # fmt: skip
    out: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    start_s = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params[i])
    while engine.num_unfinished():
        for step in engine.step():
            out[step.request_id] += step.new_token_ids
    elapsed_s = time.perf_counter() - start_s
    return list(out.values()), sum(map(len, out.values())), elapsed_s


def _prefill_logits(engine: Any, prompts: list[str]) -> Any:  # [sum of prompt lengths, V] float32
    from workers.engine.model_runner import ForwardItem

    items, next_block = [], 0
    for prompt in prompts:
        ids = engine.tokenizer.encode(prompt, add_special_tokens=False)
        num_blocks = -(-len(ids) // engine.cfg.block_size)
        items.append(ForwardItem(ids, 0, list(range(next_block, next_block + num_blocks)), num_logits=len(ids)))
        next_block += num_blocks
    return engine.runner.forward(items)


def bench_tp(quick: bool) -> dict[str, Any]:
    from workers.demo.corpus import held_out_prompts
    from workers.models.sharded_llama import resident_weight_bytes

    num_prompts, max_tokens, num_rounds = (4, 32, 1) if quick else (8, 64, 2)
    prompts = held_out_prompts(num_prompts)
    rows: list[dict[str, Any]] = []
    ratios: dict[str, float] = {}
    matches: list[bool] = []
    for dtype in ("auto",) if quick else ("auto", "float32"):
        tp1, tp2 = _engine(dtype, 1), _engine(dtype, 2)
        try:
            totals: dict[tuple[str, int], list[float]] = {(mode, tp): [0, 0.0] for mode in MODES for tp in (1, 2)}
            for _ in range(num_rounds):
                for mode in MODES:
                    expected, num_tokens, seconds = _run(tp1, prompts, mode, max_tokens)
                    got, num_tokens_2, seconds_2 = _run(tp2, prompts, mode, max_tokens)
                    matches += [a == b for a, b in zip(expected, got, strict=True)]
                    for tp, n, s in ((1, num_tokens, seconds), (2, num_tokens_2, seconds_2)):
                        totals[(mode, tp)][0] += n
                        totals[(mode, tp)][1] += s
            full_bytes = resident_weight_bytes(tp1.runner.model)
            fractions = [b / full_bytes for b in tp2.runner.group.rank_weight_bytes]
            for (mode, tp), (total_tokens, total_s) in totals.items():
                rows.append({
                    "dtype": str(tp1.runner.model.embed.weight.dtype).removeprefix("torch."), "speculative": mode,
                    "tp": tp, "tokens_per_s": round(total_tokens / total_s, 1),
                    "weight_fraction": "1.0" if tp == 1 else " / ".join(f"{f:.3f}" for f in fractions),
                })  # fmt: skip
            if dtype == "auto":
                speed = {key: n / s for key, (n, s) in totals.items()}
                ratios["tp2_vs_tp1_tokens_per_s"] = round(speed[("none", 2)] / speed[("none", 1)], 3)
                ratios["tp2_vs_tp1_tokens_per_s_spec"] = round(speed[("draft", 2)] / speed[("draft", 1)], 3)
                ratios["tp2_rank_weight_fraction"] = round(max(fractions), 3)
            if dtype == "float32":
                diff = (_prefill_logits(tp1, prompts) - _prefill_logits(tp2, prompts)).abs().max().item()
                ratios["tp2_max_logit_diff_fp32"] = float(f"{diff:.3g}")
        finally:
            tp2.close()
    ratios["tp2_greedy_match"] = sum(matches) / len(matches)
    return {"rows": rows, "ratios": ratios, "num_prompts": num_prompts, "max_tokens": max_tokens,
            "num_rounds": num_rounds}  # fmt: skip


def bench_tp_command(quick: bool, json_path: str | None) -> int:
    load_before = os.getloadavg()[0]
    result = bench_tp(quick)
    load_after = os.getloadavg()[0]
    typer.echo(format_table(result["rows"], ["dtype", "speculative", "tp", "tokens_per_s", "weight_fraction"]))
    for key, value in result["ratios"].items():
        typer.echo(f"{key}: {value}")
    typer.echo(f"load average (1 min) before {load_before:.2f}, after {load_after:.2f}")
    if json_path:
        machine = machine_info(quick=quick, num_prompts=result["num_prompts"], max_tokens=result["max_tokens"],
                               num_rounds=result["num_rounds"], load_avg_1m_before=load_before,
                               load_avg_1m_after=load_after)  # fmt: skip
        write_json(json_path, "tp", machine, result["rows"], result["ratios"])
    return 0 if result["ratios"]["tp2_greedy_match"] == 1.0 else 1
