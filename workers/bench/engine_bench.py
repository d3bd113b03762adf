"""`specfleet bench engine`: our plain decoding vs transformers `generate` on the demo target.

Greedy, 128 new tokens (EOS ignored so every run emits the same count), held-out prompts, one run:
batch 1 for both; 4/16/32 concurrent requests for ours (continuous batching) and for transformers
(one at a time, and one padded batch).
"""

import contextlib
import dataclasses
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from shared.speculation import SpeculativeMethod
from workers.demo.train import pinned_threads
from workers.engine.config import EngineConfig
from workers.engine.engine import Engine
from workers.engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineBenchPlan:
    num_new_tokens: int = 128
    num_bs1_prompts: int = 8
    concurrencies: tuple[int, ...] = (4, 16, 32)

    @classmethod
    def quick(cls) -> "EngineBenchPlan":
        return cls(num_new_tokens=128, num_bs1_prompts=3, concurrencies=(4, 16))


def run_ours(engine: Engine, prompts: list[list[int]], num_new: int) -> tuple[float, list[list[int]]]:
    """All prompts submitted at once; returns (seconds, generated tokens per prompt)."""
    params = SamplingParams(max_tokens=num_new, temperature=0.0, ignore_eos=True)
    generated: dict[str, list[int]] = {}
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"b{i}", prompt, params)
        generated[f"b{i}"] = []
    while engine.num_unfinished():
        for out in engine.step():
            generated[out.request_id].extend(out.new_token_ids)
    return time.perf_counter() - start, [generated[f"b{i}"] for i in range(len(prompts))]


@torch.inference_mode()
def run_hf(model, prompts: list[list[int]], num_new: int, pad_id: int) -> tuple[float, list[list[int]]]:
    """One padded batch (left padding) through transformers generate."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)  # [B, W]
    mask = torch.zeros_like(ids)  # [B, W]
    for b, p in enumerate(prompts):
        ids[b, width - len(p) :] = torch.tensor(p)
        mask[b, width - len(p) :] = 1
    start = time.perf_counter()
    out = model.generate(
        ids, attention_mask=mask, max_new_tokens=num_new, min_new_tokens=num_new, do_sample=False, pad_token_id=pad_id
    )  # [B, W + num_new]
    return time.perf_counter() - start, out[:, width:].tolist()


def run_hf_serial(model, prompts: list[list[int]], num_new: int, pad_id: int) -> tuple[float, list[list[int]]]:
    seconds, outs = 0.0, []
    for p in prompts:
        s, o = run_hf(model, [p], num_new, pad_id)
        seconds += s
        outs.extend(o)
    return seconds, outs


def match_rate(a: list[list[int]], b: list[list[int]]) -> float:
    """Fraction of positions equal up to and including the first divergence point of each pair."""
    same = total = 0
    for x, y in zip(a, b, strict=True):
        total += len(x)
        same += next((i for i, (p, q) in enumerate(zip(x, y, strict=False)) if p != q), len(x))
    return same / total if total else 1.0


def hf_threads(engine: Engine) -> contextlib.AbstractContextManager[None]:
    """transformers runs with the engine's full thread count (the engine itself drops to one thread for
    small passes; transformers has no such policy, and at batch 1 it is faster with all threads)."""
    policy = engine.runner.threads
    return pinned_threads(policy.num_threads if policy is not None else torch.get_num_threads())


def bench_engine(target_dir: Path, prompts_text: list[str], plan: EngineBenchPlan, cfg: EngineConfig) -> dict[str, Any]:
    import transformers

    engine = Engine(dataclasses.replace(cfg, speculative_method=SpeculativeMethod.NONE), target_dir)  # plain decoding
    dtype = engine.runner.model.embed.weight.dtype
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=dtype).eval()
    pad_id = engine.tokenizer.pad_token_id or next(iter(engine.eos_token_ids), 0)
    prompts = [engine.tokenizer.encode(t, add_special_tokens=False) for t in prompts_text]
    n = plan.num_new_tokens
    run_ours(engine, prompts[:1], 8)  # warm-up: first-call allocations, thread pools
    with hf_threads(engine):
        run_hf(hf, prompts[:1], 8, pad_id)

    rows: list[dict[str, Any]] = []
    bs1 = prompts[: plan.num_bs1_prompts]
    ours_s, ours_out = 0.0, []
    for p in bs1:
        s, o = run_ours(engine, [p], n)
        ours_s += s
        ours_out.extend(o)
    with hf_threads(engine):
        hf_s, hf_out = run_hf_serial(hf, bs1, n, pad_id)
    ours_bs1 = len(bs1) * n / ours_s
    hf_bs1 = len(bs1) * n / hf_s
    rows.append({"system": "specfleet", "concurrency": 1, "tokens_per_s": ours_bs1, "greedy_match_vs_hf": match_rate(ours_out, hf_out)})
    rows.append({"system": "hf_generate", "concurrency": 1, "tokens_per_s": hf_bs1})
    ratios: dict[str, float] = {"plain_vs_hf_bs1": ours_bs1 / hf_bs1}
    for c in plan.concurrencies:
        batch = [prompts[i % len(prompts)] for i in range(c)]
        s, _ = run_ours(engine, batch, n)
        rows.append({"system": "specfleet", "concurrency": c, "tokens_per_s": c * n / s})
        ratios[f"concurrency{c}_vs_bs1"] = c * n / s / ours_bs1
        with hf_threads(engine):
            s, _ = run_hf(hf, batch, n, pad_id)
        rows.append({"system": "hf_generate_padded", "concurrency": c, "tokens_per_s": c * n / s})
        rows.append({"system": "hf_generate_serial", "concurrency": c, "tokens_per_s": hf_bs1})
        ratios[f"concurrency{c}_vs_hf_padded"] = rows[-3]["tokens_per_s"] / rows[-2]["tokens_per_s"]
        log.info("concurrency %d done", c)
    return {"rows": rows, "ratios": ratios, "dtype": str(dtype).removeprefix("torch.")}
