"""Start-up decision to run a runner's small passes through its native decoder layers (`EngineConfig.fused_layers`,
see workers/models/fused_decode.py), for the target, the draft and an EAGLE head alike:

- `auto`: for each small-pass bucket (one token: batch-1 decode and every draft token; 2 .. the thread policy's
  single-thread limit: a short verify chain, a small decode batch), time a pass of that size through the path
  the runner would otherwise take (compiled or eager) and through the native layers, in pairs on this host, now
  (interleaved.py). Keep the native layers where they were faster beyond noise and chose the same token in
  every row; their sums run in another order than ATen's, so logits agree to rounding, not bit for bit.
- `on`: every small-pass bucket, without measuring.
- `off`: none.

Larger passes never take it: there oneDNN's and MKL's blocked products (AMX, many rows at once) win.
"""

import logging
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol

import torch

from workers.engine.compile_stats import Bucket
from workers.engine.interleaved import Verdict, time_interleaved
from workers.engine.model_runner import ForwardItem, ThreadPolicy, warm_items
from workers.models import fused_decode

log = logging.getLogger(__name__)


class FusingMode(StrEnum):
    AUTO = "auto"
    ON = "on"
    OFF = "off"


@dataclass
class FusingStats:
    """One runner's decision per bucket, and what `auto` measured (ms of its pass; empty otherwise)."""

    is_fused: dict[str, bool] = field(default_factory=lambda: {b.value: False for b in Bucket})
    reasons: dict[str, str] = field(default_factory=dict)  # bucket -> why
    timed_ms: dict[str, dict[str, float]] = field(default_factory=dict)  # bucket -> {'unfused', 'fused'} -> median


class FusableRunner(Protocol):
    """What fuse_runner needs of a runner (ModelRunner, HeadRunner)."""

    threads: ThreadPolicy | None
    block_size: int
    fused: fused_decode.FusedLayers | None
    fused_buckets: frozenset[Bucket]

    def bind_fused(self) -> fused_decode.FusedLayers | None: ...

    def probe_forward(self, items: list[ForwardItem]) -> torch.Tensor: ...


def fuse_runner(runner: FusableRunner, mode: FusingMode, name: str) -> FusingStats:
    """Bind `runner`'s native layers and choose the buckets they serve, per `mode`. Runs at start-up, after
    compilation (the path it is timed against is the one requests would take) and before the pass costs."""
    stats = FusingStats()
    if mode is FusingMode.OFF:
        stats.reasons = {b.value: "off" for b in _small_buckets(runner)}
        return stats
    runner.fused = runner.bind_fused()
    if runner.fused is None:
        stats.reasons = {b.value: "needs the native kernel and a CPU float32/bfloat16 model" for b in _small_buckets(runner)}
        return stats
    for bucket, num_tokens in _small_buckets(runner).items():
        if mode is FusingMode.ON:
            is_fused, stats.reasons[bucket.value] = True, "on"
        else:
            is_fused, stats.reasons[bucket.value] = _measure(runner, bucket, num_tokens, stats)
        stats.is_fused[bucket.value] = is_fused
        if is_fused:
            runner.fused_buckets = runner.fused_buckets | {bucket}
    log.info("%s model: native layers for %s", name,
             ", ".join(f"{b} ({why})" for b, why in stats.reasons.items()))  # fmt: skip
    return stats


def _small_buckets(runner: FusableRunner) -> dict[Bucket, int]:
    """The buckets the native layers may serve, each with the token count a timed pass of it has."""
    limit = runner.threads.single_thread_max_tokens if runner.threads is not None else 1
    buckets = {Bucket.DECODE: 1}
    if limit > 1:
        buckets[Bucket.SMALL] = limit
    return buckets


def _measure(runner: FusableRunner, bucket: Bucket, num_tokens: int, stats: FusingStats) -> tuple[bool, str]:
    """(use the native layers for `bucket`, why): paired passes of a chain of `num_tokens` tokens (block 0: no
    sequence holds it at start-up) through both paths."""
    items = warm_items(num_tokens, runner.block_size)

    def run(is_fused: bool) -> torch.Tensor:
        runner.fused_buckets = runner.fused_buckets | {bucket} if is_fused else runner.fused_buckets - {bucket}
        return runner.probe_forward(items)

    comparison, logits = time_interleaved(run)
    runner.fused_buckets = runner.fused_buckets - {bucket}
    stats.timed_ms[bucket.value] = {"unfused": comparison.base_ms, "fused": comparison.variant_ms}
    if not torch.equal(logits[False].argmax(-1), logits[True].argmax(-1)):
        return False, "chose another token than the unfused pass here"
    if comparison.verdict is Verdict.FASTER:
        return True, f"faster here: {comparison.describe()}"
    return False, f"not faster here: {comparison.describe()}"
