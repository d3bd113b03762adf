"""Start-up timing of forward passes, so the first steps already choose speculation lengths from this
host's costs (workers/spec/length_policy.py); every later pass keeps the tables current.

Passes are shaped like the speculative steps they stand for: sequences of up to 1 + k_max query tokens
over a short context. They write K/V into blocks nobody holds yet at start-up; a sequence always writes
its own slots before it reads them, so nothing stale is ever read. Each size runs `num_repeats` times
after one warm-up pass, and the fastest run is recorded (the others wait on the OS or a cold cache).
"""

import logging
import time
from collections.abc import Callable

from workers.engine.model_runner import ForwardItem
from workers.spec.pass_costs import PassCostTable

log = logging.getLogger(__name__)

CONTEXT_TOKENS = 32  # committed tokens before each probe sequence's queries


def probe_sizes(max_tokens: int) -> list[int]:
    """Token counts to time: fine at the small end (batch-1 drafts and verifies), then doubling."""
    sizes = [1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128]
    return [n for n in sizes if n <= max_tokens]


def probe_items(num_tokens: int, tokens_per_seq: int, block_table: list[int]) -> list[ForwardItem]:
    """num_tokens query tokens as sequences of up to tokens_per_seq each, every one asking for its logits."""
    items = []
    left = num_tokens
    while left > 0:
        n = min(tokens_per_seq, left)
        items.append(ForwardItem([1] * n, CONTEXT_TOKENS, block_table, num_logits=n))
        left -= n
    return items


def probe(
    forward: Callable[[list[ForwardItem]], object],  # one pass of a runner, its output unused
    block_size: int,
    num_cache_blocks: int,
    table: PassCostTable,
    sizes: list[int],
    tokens_per_seq: int,
    num_repeats: int = 3,
) -> None:
    """Time a pass of each size and record the fastest in `table` (before the runner reports its passes)."""
    num_blocks = -(-(CONTEXT_TOKENS + tokens_per_seq) // block_size)
    block_table = [b % num_cache_blocks for b in range(num_blocks)]  # a tiny cache: blocks repeat (timing only)
    for num_tokens in sizes:
        items = probe_items(num_tokens, tokens_per_seq, block_table)
        forward(items)  # warm-up: first use of this shape
        best_s = float("inf")
        for _ in range(num_repeats):
            start_s = time.perf_counter()
            forward(items)
            best_s = min(best_s, time.perf_counter() - start_s)
        table.observe(num_tokens, best_s)
    log.info("pass costs (ms by tokens): %s", {n: round(ms, 2) for n, ms in table.snapshot().items()})
