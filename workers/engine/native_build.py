"""Start-up choice of the native kernel library's build (`EngineConfig.native_build`): how its linear layers sum
bfloat16 weights on a CPU with AVX512-BF16 (workers/models/decode_layers.cpp):

- `host`: the library built for this CPU (`-march=native`): bfloat16 weights in pairs, two products summed a
  lane by the CPU's dot instruction (`vdpbf16ps`), or by AMX tiles where the CPU has them.
- `portable`: the same sources built without those instructions: bfloat16 weights in columns, widened to
  float32 and summed by FMA (the path of every CPU without AVX512-BF16, tested there and here).
- `auto`: for a bfloat16 model whose host build sums in pairs, time the target's passes through both builds'
  native layers (interleaved.py: in pairs, on this host, now), one token and then doubling up to the engine's
  largest decode batch (max_num_seqs), and keep `portable` where it was not slower at one token and took less
  in all, and chose the same tokens at every size; otherwise `host`. The decision is written beside the
  libraries (`<cache_dir>/native-build/<key>.json`, the key: the host library's build, the model's shape and
  dtype, max_num_seqs) and read back by every later engine of that model on this host: the two builds sum in
  different orders, so engines that chose apart would decode apart (a bf16 token near a tie), and a job resumed
  on another worker of the host, or an engine beside another in one process (a benchmark's), must not. Delete
  the file to time again.

Why both: the dot instruction's rate differs by CPU more than its name suggests. On a 2-core Xeon with
AVX512-BF16 and no AMX (2026-12-07), `vdpbf16ps` retired 0.98 G instructions/s against 4.2 G for a float32 FMA
(independent chains, one core): 63 against 134 GFLOP/s, so the widened float32 products ran the demo target's
16-row products 1.7-2.1x faster (one thread) and its one-row ones 1.1-1.25x. Where the dot instruction is as fast
as an FMA (the AMD Zen 4 hosts the pairs layout was built on), the pairs win.

One build serves the whole engine (target, draft, EAGLE head): the choice is made on the target, which does
most of the work. Every row's sums run in the same order whatever the pass's size in either build, so a token
gets the same bits alone, in a batch, or in a prefill.
"""

import dataclasses
import hashlib
import json
import logging
import os
import tempfile
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Protocol

import torch

from workers.engine.interleaved import Verdict, time_interleaved
from workers.engine.model_runner import ForwardItem, warm_items
from workers.models import fused_decode, native_attention
from workers.models.native_attention import NativeAttention

log = logging.getLogger(__name__)

# what `portable` leaves out of `-march=native`: the bfloat16 dot instruction and the AMX tiles
PORTABLE_FLAGS = ("-mno-avx512bf16", "-mno-amx-tile")
MAX_PAIRS = 16  # pairs per size at most (fusing.py's reason: a few seconds at start-up in all)


class NativeBuild(StrEnum):
    AUTO = "auto"
    HOST = "host"
    PORTABLE = "portable"


@dataclass
class BuildChoice:
    """The build the engine's native kernels come from, why, and what `auto` measured (ms; empty otherwise)."""

    build: NativeBuild = NativeBuild.HOST
    reason: str = ""
    timed_ms: dict[int, dict[str, float]] = field(default_factory=dict)  # tokens -> {'host', 'portable'} -> median


class BuildRunner(Protocol):
    """What choose_build needs of a runner (ModelRunner)."""

    block_size: int
    native: NativeAttention | None
    fused: fused_decode.FusedLayers | None
    fused_max_tokens: int

    def use_native(self, native: NativeAttention | None) -> None: ...

    def bind_fused(self) -> fused_decode.FusedLayers | None: ...

    def probe_forward(self, items: list[ForwardItem]) -> torch.Tensor: ...


def choose_build(
    runner: BuildRunner,
    host: NativeAttention,
    mode: NativeBuild,
    dtype: torch.dtype,  # the target's
    cache_dir: Path,
    max_batch: int,
    model_key: str,  # the target's shape (its ModelConfig's repr): part of the key of `auto`'s decision file
) -> tuple[NativeAttention, BuildChoice]:
    """The library the engine's runners use (`host`, or the portable build from `cache_dir`), per `mode`. Runs at
    start-up before the runners take a library (the timed passes write from position 0 into blocks 0.., which
    no sequence holds yet); leaves `runner` without native layers, as it found it."""
    choice = BuildChoice()
    portable: NativeAttention | None = None
    path = decision_path(cache_dir, host, dtype, max_batch, model_key)
    held = _read_decision(path) if mode is NativeBuild.AUTO else None  # `auto`'s decision, timed before
    if held is not None:
        held = dataclasses.replace(held, reason=f"as timed on this host before ({path.name}): {held.reason}")
    if mode is NativeBuild.HOST:
        choice.reason = "host"
    elif dtype != torch.bfloat16 or not fused_decode.pair_rows(host, torch.bfloat16):
        choice.reason = "the host build sums this model's products as the portable one does"
    elif held is not None and held.build is NativeBuild.HOST:
        choice = held  # the portable library is neither built nor loaded
    elif (portable := native_attention.load(cache_dir, PORTABLE_FLAGS)) is None:
        choice.reason = "the portable build could not be built or loaded"
    elif mode is NativeBuild.PORTABLE:
        choice.build, choice.reason = NativeBuild.PORTABLE, "portable"
    elif held is not None:
        choice = held
    else:
        choice.build, choice.reason = _measure(runner, {NativeBuild.HOST: host, NativeBuild.PORTABLE: portable},
                                               max_batch, choice)  # fmt: skip
        _write_decision(path, choice)
    log.info("native kernels: the %s build (%s)", choice.build.value, choice.reason)
    if choice.build is NativeBuild.PORTABLE:
        assert portable is not None
        return portable, choice
    return host, choice


def decision_path(cache_dir: Path, host: NativeAttention, dtype: torch.dtype, max_batch: int, model_key: str) -> Path:
    """Where `auto`'s decision for this model on this host's library is kept."""
    key = f"{host.library_path.name}|{dtype}|{max_batch}|{model_key}"
    return cache_dir / "native-build" / f"{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def _read_decision(path: Path) -> BuildChoice | None:
    """The decision kept at `path`; None where there is none, or it does not read back (timed again)."""
    try:
        held = json.loads(path.read_text())
        timed = {int(n): {name: float(ms) for name, ms in per.items()} for n, per in held["timed_ms"].items()}
        return BuildChoice(NativeBuild(held["build"]), str(held["reason"]), timed)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def _write_decision(path: Path, choice: BuildChoice) -> None:
    """Keep `choice` at `path` (written whole: a temporary file renamed into place); logged where it cannot be."""
    record = {"build": choice.build.value, "reason": choice.reason, "timed_ms": choice.timed_ms}
    tmp_name = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(dir=path.parent, suffix=".json.tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(record, f)
        os.replace(tmp_name, path)
    except OSError as exc:
        log.warning("could not keep the native build's decision at %s (%s): the next engine times again", path, exc)
        if tmp_name is not None and os.path.exists(tmp_name):
            os.unlink(tmp_name)


def batch_sizes(max_batch: int) -> list[int]:
    """The token counts `auto` times: 1, then doubling, up to max_batch (included where it is no power of 2)."""
    sizes = [1]
    while sizes[-1] * 2 <= max_batch:
        sizes.append(sizes[-1] * 2)
    if sizes[-1] < max_batch:
        sizes.append(max_batch)
    return sizes


def _measure(
    runner: BuildRunner, builds: dict[NativeBuild, NativeAttention], max_batch: int, choice: BuildChoice
) -> tuple[NativeBuild, str]:
    """(the build, why): paired passes of each size of batch_sizes through both builds' native layers."""
    fused = {}
    for build, library in builds.items():
        runner.use_native(library)
        fused[build] = runner.bind_fused()
    try:
        if any(layers is None for layers in fused.values()):
            return NativeBuild.HOST, "the model's layers cannot run natively"
        one_token = ""
        for num_tokens in batch_sizes(max_batch):
            items = warm_items(num_tokens, runner.block_size)

            def run(is_portable: bool, items: list[ForwardItem] = items) -> torch.Tensor:
                build = NativeBuild.PORTABLE if is_portable else NativeBuild.HOST
                runner.use_native(builds[build])
                runner.fused, runner.fused_max_tokens = fused[build], len(items[0].token_ids)
                return runner.probe_forward(items)

            comparison, logits = time_interleaved(run, max_pairs=MAX_PAIRS)
            choice.timed_ms[num_tokens] = {"host": comparison.base_ms, "portable": comparison.variant_ms}
            if not torch.equal(logits[False].argmax(-1), logits[True].argmax(-1)):
                return NativeBuild.HOST, f"at {num_tokens} tokens the builds chose different tokens"
            if num_tokens == 1:
                if comparison.verdict is Verdict.SLOWER:
                    return NativeBuild.HOST, f"portable slower at one token: {comparison.describe()}"
                one_token = comparison.describe()
    finally:
        runner.fused, runner.fused_max_tokens = None, 0
        runner.use_native(None)
    portable_ms = sum(ms["portable"] for ms in choice.timed_ms.values())
    host_ms = sum(ms["host"] for ms in choice.timed_ms.values())
    total = f"{portable_ms:.2f} vs {host_ms:.2f} ms over one pass of each size up to {max(choice.timed_ms)} tokens"
    if portable_ms >= host_ms:
        return NativeBuild.HOST, f"portable at one token {one_token}, but not faster in all: {total}"
    return NativeBuild.PORTABLE, f"portable at one token {one_token}, and in all: {total}"
