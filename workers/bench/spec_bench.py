"""`specfleet bench spec`: speculative decoding vs our plain decoding vs transformers, one run.

Greedy, 128 new tokens (EOS ignored), held-out prompts. Ours: plain, SD with a draft chain, a draft tree,
n-gram lookup, an EAGLE head's chain and its tree (when the bench is given a head), at batch 1 (prompts one
after another) and 4, 16, 32 (a closed loop: that many requests in flight, twice as many in all, timed while
every slot is busy). transformers (batch 1): plain `generate`, `generate(assistant_model=draft)` and
`generate(prompt_lookup_num_tokens=…)`. Each batch size runs in `num_rounds` rounds; in a round each of our
variants runs beside plain decoding, the two engines stepped in turn (run_interleaved), each timing its own
steps: the host's speed swings by tens of percent within seconds here, and engines run one after the other
would each carry whatever seconds they fell in. A variant's ratio to plain decoding (`vs_plain`, and what
`min_sd_vs_plain` and the other ratios read) is its tokens/s over plain's timed beside it, over the rounds;
`vs_plain_by_round` is that ratio round by round. Two of ours compare through plain (a/b = a's vs_plain over
b's). transformers runs alone in the batch-1 rounds and compares by tokens/s.
Then the same engines under a JSON schema (workers/bench/grammar_bench.py):
constrained speculation against constrained plain decoding, and sampled constrained answers checked against
their schema.
"""

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
from workers.bench.engine_bench import hf_threads, match_rate, run_hf_serial, run_ours
from workers.bench.grammar_bench import bench_grammar
from workers.engine.config import EngineConfig
from workers.engine.engine import Engine
from workers.engine.sampling_params import SamplingParams
from workers.models.eagle_head import HeadConfig

log = logging.getLogger(__name__)

VARIANTS: dict[str, dict[str, Any]] = {
    "plain": {"speculative_method": SpeculativeMethod.NONE},
    "sd_draft_chain": {"speculative_method": SpeculativeMethod.DRAFT, "tree_size": 0},
    "sd_draft_tree": {"speculative_method": SpeculativeMethod.DRAFT},  # tree_size from the plan
    "sd_ngram": {"speculative_method": SpeculativeMethod.NGRAM},
    "sd_eagle_chain": {"speculative_method": SpeculativeMethod.EAGLE, "tree_size": 0},
    "sd_eagle_tree": {"speculative_method": SpeculativeMethod.EAGLE},  # tree_size from the plan
}
EAGLE_VARIANTS = ("sd_eagle_chain", "sd_eagle_tree")
CLOSED_LOOP_WAVES = 2  # batch B > 1, per round: 2 B requests through B slots (run_interleaved)


@dataclass(frozen=True)
class SpecBenchPlan:
    num_new_tokens: int = 128
    num_bs1_prompts: int = 8
    batch_sizes: tuple[int, ...] = (1, 4, 16, 32)
    tree_size: int = 6
    json_batch_sizes: tuple[int, ...] = (1, 4, 16)  # speculation under a JSON schema (grammar_bench.py)
    num_json_sampled_runs: int = 1000  # seeded sampled constrained answers checked against their schema
    num_rounds: int = 4  # per batch size: every variant once a round, the order reversed every other round

    @classmethod
    def quick(cls) -> "SpecBenchPlan":
        return cls(
            num_bs1_prompts=4, batch_sizes=(1, 4, 16), json_batch_sizes=(1, 4), num_json_sampled_runs=100, num_rounds=2
        )


def round_orders(names: list[str], num_rounds: int) -> list[list[str]]:
    """Every variant once a round: in order, then in reverse order, and so on (A B C, C B A, A B C, ...), so no
    variant always runs first or last in its batch size's rounds (ours each beside plain decoding)."""
    return [names if r % 2 == 0 else names[::-1] for r in range(num_rounds)]


def _measure(engine: Engine, prompts: list[list[int]], batch: int, num_new: int) -> tuple[int, float, list[list[int]]]:
    """(tokens timed, seconds, every request's output) of one engine alone: _measure_together's plan."""
    return _measure_together({"one": engine}, prompts, batch, num_new)["one"]


def _measure_together(
    engines: dict[str, Engine], prompts: list[list[int]], batch: int, num_new: int
) -> dict[str, tuple[int, float, list[list[int]]]]:
    """Per engine, (tokens timed, seconds, every request's output), the engines stepped in turn (run_interleaved).
    Batch 1: the prompts one after another, all of it timed. Batch B > 1: a closed loop at concurrency B over
    CLOSED_LOOP_WAVES B requests, timed while B requests are in flight."""
    if batch == 1:
        return run_interleaved(engines, prompts, 1, num_new, len(prompts), time_to_the_end=True)
    return run_interleaved(engines, prompts, batch, num_new, CLOSED_LOOP_WAVES * batch)


class _Loop:
    """One engine's closed loop: `concurrency` requests in flight, each finished one replaced by the next prompt
    (cycled), num_requests in all. It times its own steps (and the submits they bring), until its last submit
    (every slot busy the whole time) or, with time_to_the_end, until its last token. Once all of them are
    submitted, each request that ends is replaced by a filler (`keep_busy`): untimed, its output dropped, so
    the engine goes on stepping while the others still time theirs."""

    def __init__(self, engine: Engine, prompts: list[list[int]], num_new: int, num_requests: int,
                 time_to_the_end: bool) -> None:  # fmt: skip
        self.engine, self.prompts, self.num_requests = engine, prompts, num_requests
        self.params = SamplingParams(max_tokens=num_new, temperature=0.0, ignore_eos=True)
        self.generated: list[list[int]] = [[] for _ in range(num_requests)]
        self.num_submitted = self.num_tokens = self.num_ended = self.num_fillers = 0
        self.seconds = 0.0
        self.is_timed = True
        self.time_to_the_end = time_to_the_end
        self.keep_busy = False

    @property
    def is_done(self) -> bool:
        return self.num_ended == self.num_requests

    def submit(self) -> None:
        self.engine.add_request(f"c{self.num_submitted}", self.prompts[self.num_submitted % len(self.prompts)],
                                self.params)  # fmt: skip
        self.num_submitted += 1

    def _submit_filler(self) -> None:
        self.engine.add_request(f"f{self.num_fillers}", self.prompts[self.num_fillers % len(self.prompts)],
                                self.params)  # fmt: skip
        self.num_fillers += 1

    def step(self) -> None:
        """One engine step; timed if the window was open when it began (the step that closes it counts)."""
        start, was_timed = time.perf_counter(), self.is_timed
        for out in self.engine.step():
            is_filler = out.request_id.startswith("f")
            if not is_filler:
                self.generated[int(out.request_id[1:])].extend(out.new_token_ids)
                if self.is_timed:
                    self.num_tokens += len(out.new_token_ids)
            if not out.finished:
                continue
            self.num_ended += not is_filler
            if self.num_submitted < self.num_requests:
                self.submit()
                if self.num_submitted == self.num_requests and not self.time_to_the_end:
                    self.is_timed = False  # the last submit: every slot was busy until now
            elif self.keep_busy:
                self._submit_filler()
        if self.time_to_the_end and self.is_done:
            self.is_timed = False
        if was_timed:
            self.seconds += time.perf_counter() - start

    def stop_fillers(self) -> None:
        for i in range(self.num_fillers):
            self.engine.abort(f"f{i}")


def run_interleaved(
    engines: dict[str, Engine],
    prompts: list[list[int]],
    concurrency: int,
    num_new: int,
    num_requests: int,
    time_to_the_end: bool = False,
) -> dict[str, tuple[int, float, list[list[int]]]]:
    """Each engine runs its own closed loop (_Loop), the engines stepped in turn, one step each: per engine,
    (tokens timed, its own steps' seconds, every request's output, run to the end).

    This host's speed swings by 20-30 % from one second to the next (a fixed matmul loop: 86-146 runs a
    second). Loops run one after the other land in different seconds, and two identical plain engines read
    0.75-1.43 of each other round by round. Stepped in turn, each engine's steps fall in the same seconds as
    the others' (a step is 5-40 ms), and two identical engines read 0.99-1.02 of each other. An engine that
    is through its requests before the others goes on with fillers (_Loop.keep_busy), so every engine is timed
    beside the same others from its first step to its last, not alone in a tail.

    A static batch timed to its last token would instead end in a tail where only the slowest sequences are
    left: with speculation, sequences advance at their own acceptance, and that tail of small steps (44 of 65
    steps of one EAGLE batch of 16 here) measures the batch's spread, not the engine at that concurrency."""
    loops = {name: _Loop(engine, prompts, num_new, num_requests, time_to_the_end) for name, engine in engines.items()}
    for loop in loops.values():
        loop.keep_busy = len(loops) > 1
        for _ in range(min(concurrency, num_requests)):
            loop.submit()
    while not all(loop.is_done for loop in loops.values()):
        for loop in loops.values():
            loop.step()
    for loop in loops.values():
        loop.stop_fillers()
    return {name: (loop.num_tokens, loop.seconds, loop.generated) for name, loop in loops.items()}


def bench_spec(
    pair_dirs: tuple[Path, Path],
    prompts_text: list[str],
    plan: SpecBenchPlan,
    base: EngineConfig,
    eagle_dir: Path | None = None,  # the target's EAGLE head; None: no eagle rows
) -> dict[str, Any]:
    import transformers

    target_dir, draft_dir = pair_dirs
    rows: list[dict[str, Any]] = []
    tps: dict[tuple[str, int], float] = {}
    # (variant, batch) -> its tokens/s over plain decoding's: ours over plain's timed beside it (run_interleaved)
    vs_plain: dict[tuple[str, int], float] = {}
    # (variant, batch) -> its tokens/s over plain decoding's in each round: how far one round's ratio strays
    round_ratios: dict[tuple[str, int], list[float]] = {}
    outputs: dict[tuple[str, int], list[list[int]]] = {}
    prompts: list[list[int]] = []
    variants = {k: v for k, v in VARIANTS.items() if eagle_dir is not None or k not in EAGLE_VARIANTS}
    engines: dict[str, Engine] = {}
    for name, overrides in variants.items():
        cfg = dataclasses.replace(base, **({"tree_size": plan.tree_size} | overrides))
        engines[name] = Engine(cfg, target_dir, draft_dir, eagle_dir if name in EAGLE_VARIANTS else None)
        if not prompts:
            prompts = [engines[name].tokenizer.encode(t, add_special_tokens=False) for t in prompts_text]
        engines[name].warm_pass_shapes()  # as a worker's warm-up does: oneDNN's per-shape set-up paid here
        run_ours(engines[name], prompts[:1], 8)  # warm-up
    engine = engines["plain"]
    dtype = engine.runner.model.embed.weight.dtype
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=dtype).eval()
    hf_draft = transformers.AutoModelForCausalLM.from_pretrained(str(draft_dir), dtype=dtype).eval()
    pad_id = hf.config.eos_token_id if isinstance(hf.config.eos_token_id, int) else 0
    hf_runs = {
        "hf_generate": {},
        "hf_assisted": {"assistant_model": hf_draft},
        "hf_prompt_lookup": {"prompt_lookup_num_tokens": 4},
    }

    def run_hf(name: str, used: list[list[int]]) -> tuple[int, float, list[list[int]]]:
        with hf_threads(engine):
            seconds, outs = _hf_generate(hf, used, plan.num_new_tokens, pad_id, hf_runs[name])
        return len(used) * plan.num_new_tokens, seconds, outs

    for extra in hf_runs.values():  # warm-up, as ours had
        with hf_threads(engine):
            _hf_generate(hf, prompts[:1], 8, pad_id, extra)
    for batch in plan.batch_sizes:
        names = [n for n in engines if n != "plain"] + (list(hf_runs) if batch == 1 else [])  # transformers: batch 1
        before = {name: _Counters.of(engine) for name, engine in engines.items()}
        timed = {name: [0.0, 0.0] for name in ["plain", *names]}  # tokens, seconds over the rounds
        beside = {name: [0.0, 0.0] for name in names if name in engines}  # plain's tokens, seconds beside each of ours
        by_round: dict[str, list[float]] = {name: [] for name in ["plain", *names]}  # ratio to plain in each round
        runs: dict[str, list[tuple[int, list[int]]]] = {name: [] for name in ["plain", *names]}  # (prompt, output)
        for round_index, order in enumerate(round_orders(names, plan.num_rounds)):
            # batch 1: the prompts shared out over the rounds; batch B: each round a closed loop over them all
            indices = list(range(plan.num_bs1_prompts))[round_index :: plan.num_rounds] if batch == 1 else []
            used = [prompts[i] for i in indices] if batch == 1 else prompts
            plain_in_round = [0.0, 0.0]  # plain's tokens, seconds over this round's pairs
            hf_in_round: dict[str, float] = {}  # transformers' tokens/s in this round
            for name in order:
                if name in hf_runs:
                    num_tokens, seconds, outs = run_hf(name, used)
                    if seconds > 0:
                        hf_in_round[name] = num_tokens / seconds
                else:  # beside plain decoding, stepped in turn (run_interleaved)
                    pair = _measure_together({"plain": engines["plain"], name: engines[name]}, used, batch,
                                             plan.num_new_tokens)  # fmt: skip
                    num_tokens, seconds, outs = pair[name]
                    plain_tokens, plain_s, plain_outs = pair["plain"]
                    if not plain_in_round[1]:  # greedy: every pair gives plain the same outputs
                        runs["plain"].extend(zip(indices, plain_outs, strict=True) if batch == 1 else enumerate(plain_outs))
                    for totals in (timed["plain"], beside[name], plain_in_round):
                        totals[0] += plain_tokens
                        totals[1] += plain_s
                    if seconds > 0 and plain_s > 0:
                        by_round[name].append(num_tokens / seconds / (plain_tokens / plain_s))
                timed[name][0] += num_tokens
                timed[name][1] += seconds
                runs[name].extend(zip(indices, outs, strict=True) if batch == 1 else enumerate(outs))
            if plain_in_round[1] > 0:  # batch 1 with fewer prompts than rounds: a round may have none
                by_round["plain"].append(1.0)
                for name, hf_tps in hf_in_round.items():
                    by_round[name].append(hf_tps / (plain_in_round[0] / plain_in_round[1]))
        for name in ["plain", *names]:
            tps[(name, batch)] = timed[name][0] / timed[name][1]
            if name in beside:
                vs_plain[(name, batch)] = tps[(name, batch)] / (beside[name][0] / beside[name][1])
            else:  # plain itself, and transformers: against plain decoding over the whole batch size
                vs_plain[(name, batch)] = tps[(name, batch)] / tps[("plain", batch)] if name != "plain" else 1.0
            outputs[(name, batch)] = [out for _, out in sorted(runs[name], key=lambda run: run[0])]
            row = before[name].row(engines[name], name, batch, tps[(name, batch)]) if name in engines else {
                "system": name, "batch": batch, "tokens_per_s": tps[(name, batch)]}  # fmt: skip
            match = match_rate(outputs[(name, batch)], outputs[("plain", batch)]) if name != "plain" else 1.0
            round_ratios[(name, batch)] = by_round[name]
            rows.append(row | {"vs_plain": vs_plain[(name, batch)], "match_vs_plain": match,
                               "vs_plain_by_round": by_round[name]})  # fmt: skip
            log.info("%s batch %d: %.1f tok/s", name, batch, tps[(name, batch)])
    order = list(engines) + list(hf_runs)
    rows.sort(key=lambda r: (order.index(r["system"]), r["batch"]))  # the table reads variant by variant

    bf16_match = _bf16_match_rate(pair_dirs, prompts[: plan.num_bs1_prompts], plan, base)
    rows.append({"system": "bf16_sd_draft_chain", "batch": 1, "match_vs_plain": bf16_match})
    if eagle_dir is not None:
        bf16_eagle_match = _bf16_match_rate(
            pair_dirs, prompts[: plan.num_bs1_prompts], plan, base, SpeculativeMethod.EAGLE, eagle_dir
        )
        rows.append({"system": "bf16_sd_eagle_chain", "batch": 1, "match_vs_plain": bf16_eagle_match})
    def vs(a: str, b: str, batch: int) -> float:
        """a's tokens/s over b's: through plain decoding where both are ours (each was timed beside it)."""
        if a in engines and b in engines:
            return vs_plain[(a, batch)] / vs_plain[(b, batch)]
        return tps[(a, batch)] / tps[(b, batch)]

    sd_variants = [v for v in variants if v != "plain"]
    ratios = {
        "sd_vs_plain_bs1": vs("sd_draft_chain", "plain", 1),
        "best_sd_vs_plain_bs1": max(vs(v, "plain", 1) for v in sd_variants),
        "sd_vs_hf_assisted_bs1": vs("sd_draft_chain", "hf_assisted", 1),
        "tree_vs_chain_bs1": vs("sd_draft_tree", "sd_draft_chain", 1),
        "ngram_vs_plain_bs1": vs("sd_ngram", "plain", 1),
        "hf_assisted_vs_hf_plain_bs1": vs("hf_assisted", "hf_generate", 1),
        **_min_sd_vs_plain(vs_plain, round_ratios, sd_variants, plan.batch_sizes),
        "min_greedy_match_vs_plain": min(r["match_vs_plain"] for r in rows if r["system"].startswith("sd_")),
        "bf16_greedy_match_sd_vs_plain": bf16_match,
    }
    if 4 in plan.batch_sizes:
        ratios["sd_vs_plain_bs4"] = vs("sd_draft_chain", "plain", 4)
        ratios["best_sd_vs_plain_bs4"] = max(vs(v, "plain", 4) for v in sd_variants)
    if eagle_dir is not None:
        ratios |= _eagle_ratios(vs, rows)
        ratios["bf16_greedy_match_eagle_vs_plain"] = bf16_eagle_match
    json_rows, json_ratios = bench_grammar(
        engines, prompts, plan.json_batch_sizes, plan.num_bs1_prompts, plan.num_new_tokens, plan.num_json_sampled_runs
    )
    rows += json_rows
    ratios |= json_ratios
    result: dict[str, Any] = {"rows": rows, "ratios": ratios, "dtype": str(dtype).removeprefix("torch.")}
    # each engine's start-up packing decision (linear_packing: auto): engines that decided differently differ by
    # more than their speculation
    result["linear_packing"] = {
        name: {model: st.is_packed for model, st in engine.packing.items()} for name, engine in engines.items()
    }
    if eagle_dir is not None:  # which head ran: its draft vocabulary is part of its cost
        head_cfg = HeadConfig.from_dir(eagle_dir)
        result["eagle_head"] = {"name": eagle_dir.name, "draft_vocab_size": head_cfg.draft_vocab_size or head_cfg.vocab_size}
    return result


def _min_sd_vs_plain(
    vs_plain: dict[tuple[str, int], float],
    round_ratios: dict[tuple[str, int], list[float]],
    variants: list[str],
    batch_sizes: tuple[int, ...],
) -> dict[str, float]:
    """The slowest speculative row against plain decoding (`min_sd_vs_plain`), with the standard error of that
    row's ratio as its rounds measured it (`min_sd_vs_plain_sem`): a minimum over many rows near 1.0 reads low
    by about that much."""
    slowest = min(((v, b) for v in variants for b in batch_sizes), key=vs_plain.__getitem__)
    rounds = round_ratios[slowest]
    sem = statistics.stdev(rounds) / len(rounds) ** 0.5 if len(rounds) > 1 else 0.0
    return {"min_sd_vs_plain": vs_plain[slowest], "min_sd_vs_plain_sem": sem}


@dataclass(frozen=True)
class _Counters:
    """An engine's speculation counters before a batch size's rounds: its row reports what changed since."""

    counts: Any
    chosen: tuple[int, int]
    drafted_per_position: list[int]
    accepted_per_position: list[int]
    vetoed_planned: tuple[int, int]  # (steps the goodput guard vetoed, steps planned)

    @classmethod
    def of(cls, engine: Engine) -> "_Counters":
        counts = dataclasses.replace(engine.speculator.stats.counts)
        return cls(
            counts, _chosen_totals(engine), list(counts.drafted_per_position), list(counts.accepted_per_position),
            _vetoed_planned(engine),
        )  # fmt: skip

    def row(self, engine: Engine, name: str, batch: int, tokens_per_s: float) -> dict[str, Any]:
        counts, before = engine.speculator.stats.counts, self.counts
        steps = counts.num_steps - before.num_steps
        drafted = counts.num_drafted - before.num_drafted
        return {
            "system": name, "batch": batch, "tokens_per_s": tokens_per_s,
            "tau": (counts.num_emitted - before.num_emitted) / steps if steps else 1.0,
            "acceptance_rate": (counts.num_accepted - before.num_accepted) / drafted if drafted else 0.0,
            "acceptance_per_position": _per_position_since(counts, self.drafted_per_position, self.accepted_per_position),
            "chosen_draft_tokens_per_seq_step": _chosen_since(engine, self.chosen),
            "vetoed_step_share": _share_since(_vetoed_planned(engine), self.vetoed_planned),
        }  # fmt: skip


def _vetoed_planned(engine: Engine) -> tuple[int, int]:
    """(steps the goodput guard vetoed, steps the speculator planned) so far (goodput_guard.py)."""
    return engine.speculator.stats.num_vetoed_steps, sum(n for n, _ in engine.speculator.chosen_by_batch.values())


def _share_since(now: tuple[int, int], before: tuple[int, int]) -> float:
    """The share of the steps planned in this run that the guard vetoed."""
    vetoed, planned = now[0] - before[0], now[1] - before[1]
    return vetoed / planned if planned else 0.0


def _chosen_totals(engine: Engine) -> tuple[int, int]:
    """(sequence-steps planned, draft tokens chosen) so far, over every batch size."""
    chosen = engine.speculator.chosen_by_batch
    return sum(n * b for b, (n, _) in chosen.items()), sum(t for _, t in chosen.values())


def _chosen_since(engine: Engine, before: tuple[int, int]) -> float:
    """What the length policy chose in this run: draft tokens (tree: nodes) per decoding sequence per step."""
    seq_steps, tokens = (now - then for now, then in zip(_chosen_totals(engine), before, strict=True))
    return tokens / seq_steps if seq_steps else 0.0


def _eagle_ratios(vs: Callable[[str, str, int], float], rows: list[dict[str, Any]]) -> dict[str, float]:
    """The issue's EAGLE figures: the head's chain against plain, transformers' assisted generation and the
    draft model's chain at batch 1; its tree against its chain; tau per batch size (chain). vs(a, b, batch):
    a's tokens/s over b's."""
    ratios = {
        "eagle_vs_plain_bs1": vs("sd_eagle_chain", "plain", 1),
        "eagle_vs_hf_assisted_bs1": vs("sd_eagle_chain", "hf_assisted", 1),
        "eagle_vs_draft_bs1": vs("sd_eagle_chain", "sd_draft_chain", 1),
        "eagle_tree_vs_plain_bs1": vs("sd_eagle_tree", "plain", 1),
        "eagle_tree_vs_chain_bs1": vs("sd_eagle_tree", "sd_eagle_chain", 1),
    }
    for r in rows:
        if r["system"] in EAGLE_VARIANTS and "tau" in r:
            short = r["system"].removeprefix("sd_")
            ratios[f"{short}_tau_bs{r['batch']}"] = r["tau"]
            if r["batch"] != 1:
                ratios[f"{short}_vs_plain_bs{r['batch']}"] = vs(r["system"], "plain", r["batch"])
    return ratios


def _per_position_since(counts: Any, drafted_before: list[int], accepted_before: list[int]) -> list[list[float]]:
    """[draft position] -> [accepted / drafted, drafted]: of the steps of this run whose draft reached this
    depth, the share accepted there, and how many there were."""
    rates: list[list[float]] = []
    for i, drafted in enumerate(counts.drafted_per_position):
        drafted_now = drafted - (drafted_before[i] if i < len(drafted_before) else 0)
        accepted_now = counts.accepted_per_position[i] - (accepted_before[i] if i < len(accepted_before) else 0)
        if drafted_now > 0:
            rates.append([accepted_now / drafted_now, drafted_now])
    return rates


def _bf16_match_rate(
    pair_dirs: tuple[Path, Path],
    prompts: list[list[int]],
    plan: SpecBenchPlan,
    base: EngineConfig,
    method: SpeculativeMethod = SpeculativeMethod.DRAFT,
    eagle_dir: Path | None = None,
) -> float:
    """In bf16, scoring k tokens at once can round differently from one at a time: how often SD (a `method`
    chain) still reproduces plain bf16 greedy decoding, token for token (up to each sequence's first divergence)."""
    outs = []
    for run_method in (SpeculativeMethod.NONE, method):
        cfg = dataclasses.replace(base, dtype="bfloat16", speculative_method=run_method, tree_size=0)
        engine = Engine(cfg, *pair_dirs, eagle_dir if run_method is SpeculativeMethod.EAGLE else None)
        outs.append(_measure(engine, prompts, 1, plan.num_new_tokens)[2])
    return match_rate(outs[1], outs[0])


@torch.inference_mode()
def _hf_generate(model, prompts: list[list[int]], num_new: int, pad_id: int, extra: dict) -> tuple[float, list[list[int]]]:
    if not extra:
        return run_hf_serial(model, prompts, num_new, pad_id)
    seconds, outs = 0.0, []
    for p in prompts:
        ids = torch.tensor([p])  # [1, P]
        start = time.perf_counter()
        out = model.generate(ids, max_new_tokens=num_new, min_new_tokens=num_new, do_sample=False,
                             pad_token_id=pad_id, **extra)  # [1, P + num_new]
        seconds += time.perf_counter() - start
        outs.append(out[0, len(p):].tolist())
    return seconds, outs
