"""Start-up choice of how many threads a runner's small passes get (`EngineConfig.small_pass_threads`), for the
target, the draft and an EAGLE head. Small passes are those of at most `single_thread_max_tokens` tokens: a
batch-1 decode step, a draft token, a short chain to verify.

- `one`: they run on one thread (ThreadPolicy). Op by op they are bound by memory and per-op dispatch: a second
  thread adds a fork/join per op, and a stall whenever another process holds a core.
- `all`: they run on all the runner's threads, where its passes take the native decoder layers
  (fused_decode.py): one native call a pass, whose products split their output tiles over the threads and whose
  attention splits a sequence's heads. A runner whose passes go op by op (eager or compiled: inductor's graphs
  are built for their thread count) keeps `one`.
- `auto`: as `all` where a pass of one token and a pass of single_thread_max_tokens tokens, each decoding after
  CONTEXT_TOKENS of context, were timed in pairs on this host, now (interleaved.py), and all threads won the
  one-token pass beyond noise and took no longer over both; else `one`.

A token's bits do not depend on the choice: the native products split outputs, not sums, and attention splits
whole heads (tests/workers/models/test_native_attention.py), so greedy output is the same either way.
"""

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol

import torch

from workers.engine.interleaved import Verdict, time_interleaved
from workers.engine.model_runner import ForwardItem, ThreadPolicy

log = logging.getLogger(__name__)

# the timed passes decode after this much context (start-up: blocks no sequence holds), so that attention, which
# a decode step of a real sequence also pays, is in the times; capped by the cache and the model's length
CONTEXT_TOKENS = 128


class SmallPassThreads(StrEnum):
    AUTO = "auto"
    ONE = "one"
    ALL = "all"


@dataclass
class ThreadChoice:
    """One runner's decision, and what `auto` measured (ms of its passes; empty otherwise)."""

    num_threads: int = 1  # threads of its passes of up to single_thread_max_tokens tokens
    reason: str = ""
    timed_ms: dict[int, dict[str, float]] = field(default_factory=dict)  # tokens -> {'one', 'all'} -> median


class ThreadedRunner(Protocol):
    """What choose_threads needs of a runner (ModelRunner, HeadRunner)."""

    threads: ThreadPolicy | None
    block_size: int
    fused_max_tokens: int

    def probe_forward(self, items: list[ForwardItem]) -> torch.Tensor: ...


def choose_threads(runner: ThreadedRunner, mode: SmallPassThreads, name: str, max_context: int) -> ThreadChoice:
    """Set `runner`'s thread policy for its small passes, per `mode`. Runs at start-up after fusing.py's choice
    (the native layers are what make all threads pay) and before the pass costs, which must be timed as requests
    will run. max_context: how many tokens from position 0 the timed passes may span (cache, model length)."""
    choice = ThreadChoice()
    policy = runner.threads
    if policy is None or policy.num_threads == 1 or policy.single_thread_max_tokens == 0:
        choice.num_threads = policy.num_threads if policy is not None else torch.get_num_threads()
        choice.reason = "every pass already runs on the same threads"
        return choice
    limit = policy.single_thread_max_tokens
    all_threads = dataclasses.replace(policy, single_thread_max_tokens=0)  # every pass on policy.num_threads
    if mode is SmallPassThreads.ONE:
        choice.reason = "one"
    elif runner.fused_max_tokens < limit:
        choice.reason = "its small passes go op by op, not through the native layers"
    elif mode is SmallPassThreads.ALL:
        choice.num_threads, choice.reason = policy.num_threads, "all"
    else:
        choice.num_threads, choice.reason = _measure(runner, policy, all_threads, min(limit, max_context), max_context,
                                                     choice)
    if choice.num_threads > 1:
        runner.threads = all_threads
    log.info("%s model: passes of up to %d tokens on %d thread(s) (%s)", name, limit, choice.num_threads,
             choice.reason)
    return choice


def _measure(
    runner: ThreadedRunner, policy: ThreadPolicy, all_threads: ThreadPolicy, limit: int, max_context: int,
    choice: ThreadChoice,
) -> tuple[int, str]:
    """(threads, why): paired passes of 1 and `limit` tokens under `policy` (one thread) and `all_threads`."""
    verdict = ""
    try:
        for num_tokens in sorted({1, limit}):
            context = max(0, min(CONTEXT_TOKENS, max_context - num_tokens))
            # interleaved.py's pairs up to its default count: these passes cost about a millisecond each
            comparison, _ = time_interleaved(_paired_run(runner, policy, all_threads, num_tokens, context))
            choice.timed_ms[num_tokens] = {"one": comparison.base_ms, "all": comparison.variant_ms}
            if num_tokens == 1:
                if comparison.verdict is not Verdict.FASTER:
                    return 1, f"all threads not faster at one token: {comparison.describe()}"
                verdict = comparison.describe()
    finally:
        runner.threads = policy
    all_ms = sum(ms["all"] for ms in choice.timed_ms.values())
    one_ms = sum(ms["one"] for ms in choice.timed_ms.values())
    total = f"{all_ms:.2f} vs {one_ms:.2f} ms over a pass of each size"
    if all_ms > one_ms:
        return 1, f"all threads faster at one token ({verdict}), but slower in all: {total}"
    return policy.num_threads, f"all threads faster at one token ({verdict}), and in all: {total}"


def _paired_run(
    runner: ThreadedRunner, one: ThreadPolicy, all_threads: ThreadPolicy, num_tokens: int, context: int
) -> Callable[[bool], torch.Tensor]:
    """run(on_all_threads): one start-up pass of `num_tokens` tokens after `context` positions, into blocks no
    sequence holds."""
    blocks = list(range(-(-(context + num_tokens) // runner.block_size)))
    items = [ForwardItem([0] * num_tokens, context, blocks, num_logits=num_tokens)]

    def run(on_all_threads: bool) -> torch.Tensor:
        runner.threads = all_threads if on_all_threads else one
        return runner.probe_forward(items)

    return run
