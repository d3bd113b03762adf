"""Measurements of a built pair that tell whether speculation is worth it: forward cost and agreement.

Agreement and the first cost table use the `transformers` models (the build's reference); the `engine_`
cost figures use the worker's own model code. All fp32, on the caller's pinned torch threads.
"""

import functools
import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import DynamicCache, PreTrainedModel

from workers.demo.build import DemoPair, build_record
from workers.demo.corpus import held_out_prompts
from workers.models.threads import pinned_threads

logger = logging.getLogger(__name__)

COST_NUM_CACHED_TOKENS = 128
COST_NUM_NEW_TOKENS = (1, 4, 16)


@dataclass(frozen=True)
class Agreement:
    """Draft-vs-target greedy agreement along the target's greedy continuations."""

    num_positions: int  # positions compared, over all prompts
    num_agreed: int  # positions where the draft's argmax equals the target's argmax
    num_bigrams: int  # token bigrams in the target's continuations (one list per prompt)
    num_distinct_bigrams: int  # distinct ones, counted per continuation

    @property
    def rate(self) -> float:
        return self.num_agreed / self.num_positions if self.num_positions else 0.0

    @property
    def distinct_bigram_rate(self) -> float:
        """Near 0 when the target loops (`the the the ...`): agreement on such text is cheap and says little."""
        return self.num_distinct_bigrams / self.num_bigrams if self.num_bigrams else 0.0


@dataclass(frozen=True)
class ForwardCost:
    """Wall time of one forward over repeated runs."""

    median_ms: float
    min_ms: float  # the least disturbed run: the better estimate on a shared, noisy machine


def _time_in_turns(
    runs: dict[str, Callable[[], object]], num_repeats: int, after: Callable[[str], object] | None = None
) -> dict[str, ForwardCost]:
    """Time each run `num_repeats` times (after 3 untimed warm-ups), the runs taking turns within a repeat
    so that a burst of load from other processes hits all of them; `after(name)` runs untimed after each."""
    timings_ms: dict[str, list[float]] = {name: [] for name in runs}
    for repeat in range(num_repeats + 3):
        for name, run in runs.items():
            start_s = time.perf_counter()
            run()
            elapsed_ms = (time.perf_counter() - start_s) * 1000
            if after is not None:
                after(name)
            if repeat >= 3:
                timings_ms[name].append(elapsed_ms)
    return {
        name: ForwardCost(median_ms=statistics.median(runs_ms), min_ms=min(runs_ms))
        for name, runs_ms in timings_ms.items()
    }


@torch.inference_mode()
def forward_costs(
    models: dict[str, PreTrainedModel], num_new_tokens: int, num_cached_tokens: int, num_repeats: int = 50
) -> dict[str, ForwardCost]:
    """Cost of one forward of `num_new_tokens` tokens with `num_cached_tokens` already in each model's cache.

    The models run in turn within each repeat, so a burst of load from other processes hits all of them.
    """
    vocab_size = min(model.config.vocab_size for model in models.values())
    generator = torch.Generator().manual_seed(0)
    context = torch.randint(1, vocab_size, (1, num_cached_tokens + num_new_tokens), generator=generator)
    new_tokens = context[:, num_cached_tokens:]  # [1, new]
    caches = {name: DynamicCache(config=model.config) for name, model in models.items()}
    for name, model in models.items():
        model(input_ids=context[:, :num_cached_tokens], cache=caches[name], use_cache=True)
    return _time_in_turns(
        {name: functools.partial(model, input_ids=new_tokens, cache=caches[name], use_cache=True)
         for name, model in models.items()},
        num_repeats,
        after=lambda name: caches[name].crop(-num_new_tokens),  # a negative count = tokens to remove
    )  # fmt: skip


@torch.inference_mode()
def engine_forward_costs(
    model_dirs: dict[str, Path], num_new_tokens: int, num_cached_tokens: int, num_repeats: int = 50
) -> dict[str, ForwardCost]:
    """The same timing as `forward_costs`, through the worker's own model code and paged KV cache (fp32).

    This is the forward speculation actually runs: block-table metadata, paged attention, logits for
    the new tokens only.
    """
    from workers.engine.model_runner import ForwardItem, ModelRunner
    from workers.models.loader import load_model

    block_size = 16
    num_blocks = -(-(num_cached_tokens + num_new_tokens) // block_size)  # [blocks] one sequence's worth
    block_table = list(range(num_blocks))
    runners = {
        name: ModelRunner(load_model(model_dir, torch.float32), num_blocks, block_size)
        for name, model_dir in model_dirs.items()
    }
    vocab_size = min(runner.model.cfg.vocab_size for runner in runners.values())
    generator = torch.Generator().manual_seed(0)
    context = torch.randint(
        1, vocab_size, (num_cached_tokens + num_new_tokens,), generator=generator
    ).tolist()
    for runner in runners.values():
        runner.forward([ForwardItem(context[:num_cached_tokens], 0, block_table, num_logits=1)])
    step = ForwardItem(context[num_cached_tokens:], num_cached_tokens, block_table, num_logits=num_new_tokens)
    # each run rewrites the same KV slots: the cache stays at num_cached_tokens
    return _time_in_turns(
        {name: functools.partial(runner.forward, [step]) for name, runner in runners.items()}, num_repeats
    )


@torch.inference_mode()
def greedy_agreement(
    target: PreTrainedModel, draft: PreTrainedModel, prompts_ids: list[list[int]], max_new_tokens: int
) -> Agreement:
    """Fraction of positions where the draft's argmax equals the target's along the target's greedy path.

    For each prompt the target continues greedily for `max_new_tokens` tokens (stopping at EOS); then both
    draft scores prompt + continuation in one pass and its argmax is compared at every position that
    predicts a continuation token (the target's argmax there is the continuation token itself).
    """
    eos_token_id = target.config.eos_token_id
    num_positions = 0
    num_agreed = 0
    num_bigrams = 0
    num_distinct_bigrams = 0
    for prompt_ids in prompts_ids:
        ids = torch.tensor([prompt_ids])  # [1, prompt]
        cache = DynamicCache(config=target.config)
        logits = target(input_ids=ids, cache=cache, use_cache=True).logits  # [1, prompt, vocab]
        continuation: list[int] = []
        while len(continuation) < max_new_tokens:
            next_id = int(logits[0, -1].argmax())
            continuation.append(next_id)
            if next_id == eos_token_id:
                break
            logits = target(input_ids=torch.tensor([[next_id]]), cache=cache, use_cache=True).logits
        full = torch.tensor([prompt_ids + continuation])  # [1, prompt + new]
        span = slice(len(prompt_ids) - 1, full.shape[1] - 1)  # positions that predict the continuation
        target_argmax = torch.tensor(continuation)  # [new]
        draft_argmax = draft(input_ids=full).logits[0, span].argmax(-1)  # [new]
        num_positions += target_argmax.numel()
        num_agreed += int((target_argmax == draft_argmax).sum())
        bigrams = list(zip(continuation, continuation[1:], strict=False))
        num_bigrams += len(bigrams)
        num_distinct_bigrams += len(set(bigrams))
    logger.info("agreement: %d of %d positions", num_agreed, num_positions)
    return Agreement(
        num_positions=num_positions,
        num_agreed=num_agreed,
        num_bigrams=num_bigrams,
        num_distinct_bigrams=num_distinct_bigrams,
    )


def _add_cost_figures(
    figures: dict[str, Any], prefix: str, costs: dict[str, ForwardCost], num_new_tokens: int
) -> None:
    for stat in ("median_ms", "min_ms"):
        target_ms, draft_ms = getattr(costs["target"], stat), getattr(costs["draft"], stat)
        figures[f"{prefix}target_{stat}_{num_new_tokens}tok"] = round(target_ms, 2)
        figures[f"{prefix}draft_{stat}_{num_new_tokens}tok"] = round(draft_ms, 2)
        figures[f"{prefix}cost_ratio_{stat.removesuffix('_ms')}_{num_new_tokens}tok"] = round(
            target_ms / draft_ms, 2
        )


def _dir_size_mb(directory: Path) -> float:
    return round(sum(path.stat().st_size for path in directory.iterdir() if path.is_file()) / 1e6, 2)


def measure_pair(pair: DemoPair, num_prompts: int, max_new_tokens: int, num_threads: int) -> dict[str, Any]:
    """All figures of a built pair: sizes, build time, forward cost (ms) and greedy agreement."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    record = build_record(pair)
    target = AutoModelForCausalLM.from_pretrained(pair.target_dir, dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_pretrained(pair.draft_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(pair.target_dir)
    figures: dict[str, Any] = {
        "pair": record["name"],
        "build_time_s": record["build_time_s"],
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "num_threads": num_threads,
    }
    for role, model, directory in (("target", target, pair.target_dir), ("draft", draft, pair.draft_dir)):
        figures[f"{role}_num_params"] = sum(p.numel() for p in model.parameters())
        figures[f"{role}_size_mb"] = _dir_size_mb(directory)
        figures[f"{role}_held_out_loss"] = record["models"][role]["held_out_loss"]
    with pinned_threads(num_threads):
        for num_new_tokens in COST_NUM_NEW_TOKENS:
            hf_costs = forward_costs(
                {"target": target, "draft": draft}, num_new_tokens, COST_NUM_CACHED_TOKENS
            )
            engine_costs = engine_forward_costs(
                {"target": pair.target_dir, "draft": pair.draft_dir}, num_new_tokens, COST_NUM_CACHED_TOKENS
            )
            for prefix, costs in (("", hf_costs), ("engine_", engine_costs)):
                _add_cost_figures(figures, prefix, costs, num_new_tokens)
        prompts_ids = [tokenizer(prompt)["input_ids"] for prompt in held_out_prompts(num_prompts)]
        agreement = greedy_agreement(target, draft, prompts_ids, max_new_tokens)
    figures["agreement_positions"] = agreement.num_positions
    figures["agreement_rate"] = round(agreement.rate, 4)
    figures["target_distinct_bigram_rate"] = round(agreement.distinct_bigram_rate, 4)
    return figures
