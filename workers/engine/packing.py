"""Start-up decision to prepack a runner's linear weights (`EngineConfig.linear_packing`, see
workers/models/packed_linear.py), for the target, the draft and an EAGLE head alike:

- `auto`: for a bfloat16 model, time its one-token pass unpacked and packed in pairs on this host, now
  (interleaved.py); keep the packing unless the unpacked pass was faster beyond noise, or the packed one
  returned other logits (the same oneDNN kernel, so it should not: a host where it does keeps the unpacked
  path). Where the pairs cannot tell the two apart, packing stays: it is the path oneDNN is built for, and a
  start-up timing taken in a noisy second once unpacked a target whose steps then ran 4-11 % slower for its
  whole life.
  float32 stays unpacked: there the unpacked product is MKL's, whose rounding differs from oneDNN's, and packing
  measured no faster.
- `on`: pack every float32 or bfloat16 CPU linear, without measuring.
- `off`: nothing is packed.
"""

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum

import torch
from torch import nn

from workers.engine.interleaved import Verdict, time_interleaved
from workers.models import packed_linear

log = logging.getLogger(__name__)


class PackingMode(StrEnum):
    AUTO = "auto"
    ON = "on"
    OFF = "off"


@dataclass
class PackingStats:
    """One model's decision, and what `auto` measured (ms of its one-token pass; empty otherwise)."""

    is_packed: bool = False
    reason: str = ""
    timed_ms: dict[str, float] = field(default_factory=dict)  # 'unpacked' | 'packed' -> median ms
    num_timed_pairs: int = 0  # auto: the pairs of passes its verdict rests on


def pack_model(
    model: nn.Module, one_token_pass: Callable[[], torch.Tensor], mode: PackingMode, name: str
) -> PackingStats:
    """Pack `model`'s linears per `mode`. one_token_pass(): a start-up pass of one token (its K/V land in a
    block no sequence owns) returning its logits, for `auto`'s timing and bitwise check."""
    layers = packed_linear.layers_of(model)
    stats = PackingStats()
    if mode is PackingMode.OFF or not layers:
        stats.reason = "off" if mode is PackingMode.OFF else (
            "no linear oneDNN packs here: none on the CPU in float32/bfloat16, no oneDNN, or bfloat16 on a CPU "
            "without oneDNN's bfloat16 path"
        )
        return stats
    if mode is PackingMode.AUTO and layers[0].weight.dtype != torch.bfloat16:
        stats.reason = f"auto packs bfloat16 models only ({layers[0].weight.dtype} here)"
        return stats
    packed_linear.pack(layers)
    stats.is_packed, stats.reason = True, "on"
    if mode is PackingMode.AUTO:
        stats.is_packed, stats.reason = _measure(layers, one_token_pass, stats)
        if not stats.is_packed:
            packed_linear.unpack(layers)
    log.info("%s model: linear weights %s (%s)", name, "prepacked" if stats.is_packed else "unpacked", stats.reason)
    return stats


def _measure(
    layers: list[packed_linear.Linear], one_token_pass: Callable[[], torch.Tensor], stats: PackingStats
) -> tuple[bool, str]:
    """(keep the packing, why): paired passes of both paths, and their logits compared bit for bit."""
    packed = [layer.packed for layer in layers]

    def run(is_packed: bool) -> torch.Tensor:
        for layer, weight in zip(layers, packed, strict=True):
            layer.packed = weight if is_packed else None
        return one_token_pass()

    comparison, logits = time_interleaved(run)
    for layer, weight in zip(layers, packed, strict=True):
        layer.packed = weight
    stats.timed_ms = {"unpacked": comparison.base_ms, "packed": comparison.variant_ms}
    stats.num_timed_pairs = comparison.num_pairs
    if not torch.equal(logits[False], logits[True]):
        return False, "the packed product's bits differ on this host"
    if comparison.verdict is Verdict.SLOWER:
        return False, f"slower here: {comparison.describe()}"
    if comparison.verdict is Verdict.SAME:
        return True, f"no clear difference here, kept: {comparison.describe()}"
    return True, f"faster here: {comparison.describe()}"
