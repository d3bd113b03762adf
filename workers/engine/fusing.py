"""Start-up decision to run a runner's passes through its native decoder layers (`EngineConfig.fused_layers`, see
workers/models/fused_decode.py), for the target, the draft and an EAGLE head:

- `auto`: time a pass of 1 token (batch-1 decode, every draft token), then of the thread policy's
  single-thread limit, then of twice as many tokens, and so on up to the engine's largest pass, each through the
  path the runner would otherwise take (compiled or eager) and through the native layers, in pairs on this host,
  now (interleaved.py). All or nothing: the native layers serve every pass where they won the one-token pass
  beyond noise and one pass of each size took no longer through them in all; otherwise none. A size limit would
  let a row's bits depend on the size of the pass it falls in (their sums run in another order than oneDNN's:
  logits agree to rounding, not bit for bit), and decoding, a verified chain and a resumed job's prefill must
  agree. They also give up where some row chose another token than the other path.
- `on`: every pass, without measuring.
- `off`: none.
"""

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol

import torch

from workers.engine.interleaved import Verdict, time_interleaved
from workers.engine.model_runner import ForwardItem, ThreadPolicy, warm_items
from workers.models import fused_decode

log = logging.getLogger(__name__)

# pairs per size at most (interleaved.py's default allows 48): the large passes cost tens of ms each, and a size
# the pairs cannot tell apart ends the search anyway; 16 keep the whole search to a few seconds at start-up
MAX_PAIRS = 16


class FusingMode(StrEnum):
    AUTO = "auto"
    ON = "on"
    OFF = "off"


@dataclass
class FusingStats:
    """One runner's decision, and what `auto` measured (ms of its passes; empty otherwise)."""

    max_tokens: int = 0  # passes of at most this many tokens take the native layers (0: none)
    reason: str = ""
    timed_ms: dict[int, dict[str, float]] = field(default_factory=dict)  # tokens -> {'unfused', 'fused'} -> median


class FusableRunner(Protocol):
    """What fuse_runner needs of a runner (ModelRunner, HeadRunner)."""

    threads: ThreadPolicy | None
    block_size: int
    fused: fused_decode.FusedLayers | None
    fused_max_tokens: int

    def bind_fused(self) -> fused_decode.FusedLayers | None: ...

    def probe_forward(self, items: list[ForwardItem]) -> torch.Tensor: ...


def fuse_runner(runner: FusableRunner, mode: FusingMode, name: str, max_tokens: int) -> FusingStats:
    """Bind `runner`'s native layers and choose the passes they serve, per `mode`, up to `max_tokens` tokens.
    Runs at start-up, after compilation (the path it is timed against is the one requests would take) and
    before the pass costs."""
    stats = FusingStats()
    if mode is FusingMode.OFF:
        stats.reason = "off"
        return stats
    runner.fused = runner.bind_fused()
    if runner.fused is None:
        stats.reason = "needs the native kernel and a CPU float32/bfloat16 model"
        return stats
    if mode is FusingMode.ON:
        stats.max_tokens, stats.reason = max_tokens, "on"
    else:
        stats.max_tokens, stats.reason = _measure(runner, max_tokens, stats)
    runner.fused_max_tokens = stats.max_tokens
    log.info("%s model: native layers for passes of up to %d tokens (%s)", name, stats.max_tokens, stats.reason)
    return stats


def pass_sizes(runner: FusableRunner, max_tokens: int) -> list[int]:
    """The token counts `auto` times, in order: 1, the single-thread limit, then doubling, up to max_tokens."""
    limit = runner.threads.single_thread_max_tokens if runner.threads is not None else 1
    sizes, size = [1], max(limit, 2)
    while size <= max_tokens:
        sizes.append(size)
        size *= 2
    return sizes


def _measure(runner: FusableRunner, max_tokens: int, stats: FusingStats) -> tuple[int, str]:
    """(max_tokens, or 0 for none; why): paired passes of a chain of each size of pass_sizes (into blocks no
    sequence holds at start-up) through both paths. All or nothing: see the module's docstring."""
    sizes = pass_sizes(runner, max_tokens)
    one_token = ""
    for num_tokens in sizes:
        comparison, logits = time_interleaved(_paired_run(runner, num_tokens), max_pairs=MAX_PAIRS)
        runner.fused_max_tokens = 0
        stats.timed_ms[num_tokens] = {"unfused": comparison.base_ms, "fused": comparison.variant_ms}
        if not torch.equal(logits[False].argmax(-1), logits[True].argmax(-1)):
            return 0, f"at {num_tokens} tokens they chose another token than the unfused pass"
        if num_tokens == 1:
            if comparison.verdict is not Verdict.FASTER:
                return 0, f"not faster at one token: {comparison.describe()}"
            one_token = comparison.describe()
    fused_ms = sum(ms["fused"] for ms in stats.timed_ms.values())
    unfused_ms = sum(ms["unfused"] for ms in stats.timed_ms.values())
    total = f"{fused_ms:.1f} vs {unfused_ms:.1f} ms over one pass of each size up to {sizes[-1]} tokens"
    if fused_ms > unfused_ms:
        return 0, f"faster at one token ({one_token}), but slower in all: {total}"
    return max_tokens, f"faster at one token ({one_token}), and in all: {total}"


def _paired_run(runner: FusableRunner, num_tokens: int) -> Callable[[bool], torch.Tensor]:
    """run(is_fused): one start-up pass of `num_tokens` tokens through the native layers or not."""
    items = warm_items(num_tokens, runner.block_size)

    def run(is_fused: bool) -> torch.Tensor:
        runner.fused_max_tokens = num_tokens if is_fused else 0
        return runner.probe_forward(items)

    return run
