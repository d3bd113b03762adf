"""`specfleet bench engine`: our plain decoding vs transformers `generate` on the demo target.

Greedy, 128 new tokens (EOS ignored so every run emits the same count), held-out prompts, one run:
batch 1 for both; 4/16/32 concurrent requests for ours (continuous batching) and for transformers
(one at a time, and one padded batch). Ours runs four engines (VARIANTS), interleaved run by run, each first
in turn (`rotated`), over `num_rounds` rounds: eager (`compile: off`), `compile: auto` (the dense path compiled
where it measured faster at start-up), `compile: auto` with `fused_layers: off`, and eager with `native_build:
host`; the headline ratios are auto's, `compiled_vs_eager_*` and `fused_vs_unfused_*` compare it with the next
two, `native_build_vs_host_*` eager with the last (what the start-up choice of the kernels' build adds; 1.0
where it chose the host build). Also, in the same run:
the batch-1 decode rate against the memory-bandwidth bound (the weight bytes a decode step reads / a
single-thread read bandwidth measured by summing a tensor of that size: the median of samples taken before
each batch-1 prompt's runs and once after them, so the bound is this host's at the hour the decode ran), and
the draft model's cost per token, eager and compiled.
"""

import contextlib
import dataclasses
import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from shared.speculation import SpeculativeMethod
from workers.engine.compile_stats import CompileMode
from workers.engine.config import EngineConfig
from workers.engine.engine import Engine
from workers.engine.fusing import FusingMode
from workers.engine.model_runner import ForwardItem
from workers.engine.native_build import NativeBuild
from workers.engine.sampling_params import SamplingParams
from workers.models.llama import LlamaModel
from workers.models.threads import pinned_threads

log = logging.getLogger(__name__)


# the engines, run in turn: eager (nothing compiled; the native layers for every pass where `fused_layers: auto`
# measured them faster, as every engine by default), `compile: auto` (the headline), `compile: auto` without the
# native layers (what the layers add), and eager with the native kernels' host build (what `native_build: auto`'s
# choice adds: eager against it)
VARIANTS: dict[str, dict[str, Any]] = {
    "eager": {"compile": CompileMode.OFF},
    "auto": {"compile": CompileMode.AUTO},
    "unfused": {"compile": CompileMode.AUTO, "fused_layers": FusingMode.OFF},
    "host_build": {"compile": CompileMode.OFF, "native_build": NativeBuild.HOST},
}


@dataclass(frozen=True)
class EngineBenchPlan:
    num_new_tokens: int = 128
    num_bs1_prompts: int = 8
    concurrencies: tuple[int, ...] = (4, 16, 32)
    # our runs are repeated: over one round of three prompts, eager and `auto` (the same code at batch 1: both
    # run the native layers) read 1.19x apart one way and 1.17x the other in two runs (2026-12-07)
    num_rounds: int = 2

    @classmethod
    def quick(cls) -> "EngineBenchPlan":
        # 16 only: the engines start four times (`auto` twice, compiling at start-up)
        return cls(num_new_tokens=128, num_bs1_prompts=3, concurrencies=(16,), num_rounds=3)


def rotated(names: list[str], turn: int) -> list[str]:
    """`names` starting from the turn-th (modulo): the variants' order, rotated run by run, so that none always
    runs right after the bandwidth sample's `sum` or after the same engine (in a fixed order eager ran first and
    read 1.03x and 1.19x `auto` in two runs, 2026-12-06 and -07; two such engines alternated in rotation over
    eight rounds in one process read 0.97-1.03x)."""
    k = turn % len(names) if names else 0
    return names[k:] + names[:k]


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


def decode_weight_bytes(model: LlamaModel) -> int:
    """Bytes of weights one decode step reads: every parameter once (tied embeddings: once, as the head),
    except the embedding table when it is not the head (a decode step reads one row of it)."""
    seen: set[int] = set()
    total = 0
    head = model.lm_head.weight.data_ptr()
    for name, param in model.named_parameters():
        ptr = param.data_ptr()
        if ptr in seen or (name == "embed.weight" and ptr != head):
            continue
        seen.add(ptr)
        total += param.numel() * param.element_size()
    return total


def read_bandwidth_bytes_per_s(num_bytes: int, repeats: int = 15) -> float:
    """Single-thread read bandwidth: the median time of summing a float32 tensor of `num_bytes`."""
    data = torch.ones(max(1, num_bytes // 4), dtype=torch.float32)
    with pinned_threads(1):
        data.sum()  # first touch
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            data.sum()
            times.append(time.perf_counter() - start)
    return data.numel() * 4 / statistics.median(times)


def ms_per_draft_token(forward: Callable[[list[ForwardItem]], object], block_size: int, num_tokens: int = 64) -> float:
    """One sequence decoding `num_tokens` draft tokens one `forward` (a draft model's or a head's pass) at a
    time (KV from position 64 on), in ms per token. Run between benchmark runs only: it writes KV blocks no
    sequence holds then."""
    blocks = list(range(-(-(64 + num_tokens) // block_size)))
    forward([ForwardItem([1] * 64, 0, blocks, num_logits=1)])  # a context to attend to
    start = time.perf_counter()
    for pos in range(64, 64 + num_tokens):
        forward([ForwardItem([1], pos, blocks, num_logits=1)])
    return (time.perf_counter() - start) * 1e3 / num_tokens


def bench_engine(
    target_dir: Path,
    prompts_text: list[str],
    plan: EngineBenchPlan,
    cfg: EngineConfig,
    draft_dir: Path | None = None,
    eagle_dir: Path | None = None,  # the target's EAGLE head: its pass cost, eager and compiled, is measured too
) -> dict[str, Any]:
    import transformers

    plain = dataclasses.replace(cfg, speculative_method=SpeculativeMethod.NONE)  # plain decoding (the draft idle)
    engines: dict[str, Engine] = {}
    start_up_s: dict[str, float] = {}
    for variant, overrides in VARIANTS.items():
        start_s = time.perf_counter()
        engines[variant] = Engine(dataclasses.replace(plain, **overrides), target_dir, draft_dir, eagle_dir)
        start_up_s[variant] = time.perf_counter() - start_s
    engine = engines["auto"]
    dtype = engine.runner.model.embed.weight.dtype
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=dtype).eval()
    pad_id = engine.tokenizer.pad_token_id or next(iter(engine.eos_token_ids), 0)
    prompts = [engine.tokenizer.encode(t, add_special_tokens=False) for t in prompts_text]
    n = plan.num_new_tokens
    for e in engines.values():
        e.warm_pass_shapes()  # as a worker's warm-up does: oneDNN's per-shape set-up paid here
        run_ours(e, prompts[:1], 8)  # warm-up: first-call allocations, thread pools
    with hf_threads(engine):
        run_hf(hf, prompts[:1], 8, pad_id)

    rows: list[dict[str, Any]] = []
    bs1 = prompts[: plan.num_bs1_prompts]
    seconds = {v: 0.0 for v in engines}
    outs: dict[str, list[list[int]]] = {v: [] for v in engines}
    weight_bytes = decode_weight_bytes(engine.runner.model)
    bandwidths: list[float] = []  # sampled before each prompt's runs: the bound at the hour the decode ran
    turns = [(r, p) for r in range(plan.num_rounds) for p in bs1]
    for turn, (r, p) in enumerate(turns):  # interleaved prompt by prompt, each variant first in turn
        bandwidths.append(read_bandwidth_bytes_per_s(weight_bytes))
        for variant in rotated(list(engines), turn):
            s, o = run_ours(engines[variant], [p], n)
            seconds[variant] += s
            if r == 0:  # greedy: every round's tokens are the first's
                outs[variant].extend(o)
    with hf_threads(engine):
        hf_s, hf_out = run_hf_serial(hf, bs1, n, pad_id)
    ours_bs1 = {v: len(turns) * n / s for v, s in seconds.items()}
    hf_bs1 = len(bs1) * n / hf_s
    for variant in engines:
        rows.append({"system": f"specfleet_{variant}", "concurrency": 1, "tokens_per_s": ours_bs1[variant],
                     "greedy_match_vs_hf": match_rate(outs[variant], hf_out)})
    rows.append({"system": "hf_generate", "concurrency": 1, "tokens_per_s": hf_bs1})
    ratios: dict[str, float] = {"plain_vs_hf_bs1": ours_bs1["auto"] / hf_bs1,
                                "compiled_vs_eager_bs1": ours_bs1["auto"] / ours_bs1["eager"],
                                "fused_vs_unfused_bs1": ours_bs1["auto"] / ours_bs1["unfused"],
                                "native_build_vs_host_bs1": ours_bs1["eager"] / ours_bs1["host_build"]}
    for j, c in enumerate(plan.concurrencies):
        batch = [prompts[i % len(prompts)] for i in range(c)]
        batch_s = {v: 0.0 for v in engines}
        for r in range(plan.num_rounds):
            for variant in rotated(list(engines), j + r):
                batch_s[variant] += run_ours(engines[variant], batch, n)[0]
        tps = {v: plan.num_rounds * c * n / s for v, s in batch_s.items()}
        for variant in engines:
            rows.append({"system": f"specfleet_{variant}", "concurrency": c, "tokens_per_s": tps[variant]})
        with hf_threads(engine):
            s, _ = run_hf(hf, batch, n, pad_id)
        hf_padded = c * n / s
        rows.append({"system": "hf_generate_padded", "concurrency": c, "tokens_per_s": hf_padded})
        rows.append({"system": "hf_generate_serial", "concurrency": c, "tokens_per_s": hf_bs1})
        ratios[f"concurrency{c}_vs_bs1"] = tps["auto"] / ours_bs1["auto"]
        ratios[f"concurrency{c}_vs_hf_padded"] = tps["auto"] / hf_padded
        ratios[f"compiled_vs_eager_c{c}"] = tps["auto"] / tps["eager"]
        ratios[f"fused_vs_unfused_c{c}"] = tps["auto"] / tps["unfused"]
        ratios[f"native_build_vs_host_c{c}"] = tps["eager"] / tps["host_build"]
        log.info("concurrency %d done", c)

    bandwidths.append(read_bandwidth_bytes_per_s(weight_bytes))
    bandwidth = statistics.median(bandwidths)
    bound_tps = bandwidth / weight_bytes
    ratios["decode_vs_bandwidth_bound_bs1"] = ours_bs1["auto"] / bound_tps
    bound = {"weight_bytes_per_token": weight_bytes, "read_bandwidth_gb_s": bandwidth / 1e9,
             "read_bandwidth_samples_gb_s": [b / 1e9 for b in bandwidths], "bound_tokens_per_s": bound_tps,
             "decode_tokens_per_s": ours_bs1["auto"]}
    compile_info: dict[str, Any] = {
        "start_up_s": start_up_s,
        "stats": {m: dataclasses.asdict(st) for m, st in engine.compile_stats.items()},
        "fused_layers": {m: dataclasses.asdict(st) for m, st in engine.fusing.items()},
        "small_pass_threads": {m: dataclasses.asdict(c) for m, c in engine.small_pass_threads.items()},
        "native_build": dataclasses.asdict(engine.native_build) if engine.native_build is not None else None,
    }
    for _ in range(2):  # the proposers' cost per draft token, eager and `auto`, interleaved; the second pair counts
        for variant, e in engines.items():
            if e.speculator.draft is not None:
                runner = e.speculator.draft.runner
                compile_info.setdefault("draft_ms_per_token", {})[variant] = ms_per_draft_token(
                    runner.forward, runner.block_size
                )
            if e.speculator.eagle is not None:
                head = e.speculator.eagle.runner
                compile_info.setdefault("eagle_ms_per_token", {})[variant] = ms_per_draft_token(
                    head.probe_forward, head.block_size
                )
    return {"rows": rows, "ratios": ratios, "dtype": str(dtype).removeprefix("torch."), "bandwidth_bound": bound,
            "compile": compile_info}
