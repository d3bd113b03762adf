"""Start-up timing of forward passes, so the first steps already choose speculation lengths from this
host's costs (workers/spec/length_policy.py); every later pass keeps the tables current.

First the attention rates (`probe_attention`): the same passes - ATTENTION_SEQS sequences of one query row,
then of ATTENTION_ROWS rows each - over CONTEXT_TOKENS committed tokens and over ATTENTION_EXTRA_TOKENS more.
What the longer context adds to the one-row pass and to the many-row pass gives the seconds per committed key
and per query row x key (pass_costs.AttentionCost), so the tables keep only the dense part of what they see.
Then the sizes (`probe`): passes shaped like the speculative steps they stand for, sequences of up to
1 + k_max query tokens over CONTEXT_TOKENS. Probe passes write K/V into blocks nobody holds yet at start-up;
a sequence always writes its own slots before it reads them, so nothing stale is ever read by a request. Each
shape runs `num_repeats` times after one warm-up pass, and the fastest run is recorded (the others wait on
the OS or a cold cache).
"""

import logging
import time
from collections.abc import Callable

from workers.engine.model_runner import ForwardItem, attention_work
from workers.spec.pass_costs import AttentionCost, PassCostTable

log = logging.getLogger(__name__)

CONTEXT_TOKENS = 32  # committed tokens before each probe sequence's queries
ATTENTION_SEQS = 16  # sequences of the attention probe's passes (fewer where max_num_seqs or the cache is smaller)
ATTENTION_ROWS = 4  # query rows per sequence of its many-row pass (a verify of 3 draft tokens)
ATTENTION_EXTRA_TOKENS = 256  # committed tokens its long-context passes add


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
        table.observe(num_tokens, best_s, attention_work(items))
    log.info("pass costs (ms by tokens): %s", {n: round(ms, 2) for n, ms in table.snapshot().items()})


def probe_attention(
    forward: Callable[[list[ForwardItem]], object],
    block_size: int,
    num_cache_blocks: int,
    max_seqs: int,
    max_tokens: int,
    num_repeats: int = 3,
    clock: Callable[[], float] = time.perf_counter,
) -> AttentionCost:
    """Seconds per committed key and per query row x key of a runner's passes (see the module's docstring);
    zero rates where the cache or the limits leave no room for the probe's passes."""
    long_context = CONTEXT_TOKENS + ATTENTION_EXTRA_TOKENS
    blocks_per_seq = -(-(long_context + ATTENTION_ROWS) // block_size)
    num_seqs = min(ATTENTION_SEQS, max_seqs, num_cache_blocks // blocks_per_seq, max_tokens // ATTENTION_ROWS)
    if num_seqs < 1:
        return AttentionCost()
    tables = [[s * blocks_per_seq + b for b in range(blocks_per_seq)] for s in range(num_seqs)]  # a sequence each
    shapes = [(rows, context) for rows in (1, ATTENTION_ROWS) for context in (CONTEXT_TOKENS, long_context)]
    passes = {shape: [ForwardItem([1] * shape[0], shape[1], t, num_logits=shape[0]) for t in tables] for shape in shapes}
    best_s = dict.fromkeys(shapes, float("inf"))
    for items in passes.values():
        forward(items)  # warm-up
    for _ in range(num_repeats):  # the shapes in turn, so a slow moment of the host weighs on all of them
        for shape, items in passes.items():
            start_s = clock()
            forward(items)
            best_s[shape] = min(best_s[shape], clock() - start_s)
    num_keys = num_seqs * ATTENTION_EXTRA_TOKENS  # committed keys the long context adds to each pass
    one_row_s = best_s[(1, long_context)] - best_s[(1, CONTEXT_TOKENS)]  # = num_keys x (per key + per pair)
    many_rows_s = best_s[(ATTENTION_ROWS, long_context)] - best_s[(ATTENTION_ROWS, CONTEXT_TOKENS)]
    s_per_pair = max(0.0, (many_rows_s - one_row_s) / ((ATTENTION_ROWS - 1) * num_keys))
    cost = AttentionCost(s_per_key=max(0.0, one_row_s / num_keys - s_per_pair), s_per_pair=s_per_pair)
    log.info("attention costs: %.3f us per committed key, %.3f us per query row x key (%d sequences)",
             cost.s_per_key * 1e6, cost.s_per_pair * 1e6, num_seqs)  # fmt: skip
    return cost
