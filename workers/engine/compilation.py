"""Start-up compilation of a runner's dense path (`EngineConfig.compile`), and the decision to use it.

At engine start-up, for the target, the draft and the EAGLE head alike: build the runner's compiled dense path
(workers/models/compiled.py: CompiledModel, CompiledHead), compile each of its shape buckets by running one
forward of each (compile_stats.Bucket: one token, the batch-1 decode step and every draft token; small passes
on one thread; larger passes on every thread, warmed at 16 decoding sequences), so no request ever waits for a
compilation: afterwards a forward that would recompile runs eager instead (run_compiled_or_eager). Then, per
bucket:

- `on`: use the compiled graph;
- `auto`: time eager and compiled forwards of that bucket in pairs on this host, now (interleaved.py), and use
  the compiled graph only where it was faster beyond noise (no constant tuned to one host); where the pairs
  cannot tell the two apart, the bucket stays eager, the path with fewer moving parts;
- `off`: nothing is compiled.

A compilation that raises leaves the runner eager: logged, and counted in CompileStats.num_failures (the
worker exports it). Compiled artifacts (inductor's FX-graph and AOT caches) go to `cache_dir`, so a restart
reuses them instead of recompiling.
"""

import contextlib
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol, TypeVar

import torch

from workers.engine.compile_stats import Bucket, CompileMode, CompileStats
from workers.engine.interleaved import Verdict, time_interleaved
from workers.engine.model_runner import ForwardItem, ThreadPolicy

log = logging.getLogger(__name__)

C = TypeVar("C", bound="_Compiled")


class _Compiled(Protocol):
    def compiling(self) -> contextlib.AbstractContextManager[None]: ...


class Compilable(Protocol[C]):
    """What compile_runner needs of a runner (ModelRunner, HeadRunner)."""

    block_size: int
    threads: ThreadPolicy | None
    compiled: C | None
    compile_stats: CompileStats

    @property
    def kv_caches(self) -> list[tuple[torch.Tensor, torch.Tensor]]: ...

    def bucket_of(self, num_tokens: int) -> Bucket: ...

    def new_compiled(self) -> C: ...

    def forward_with(self, items: list[ForwardItem], compiled: C | None) -> torch.Tensor: ...


INDUCTOR_CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"
BATCH_WARM_SEQS = 16  # the multi-thread bucket is compiled and timed at this many decoding sequences


def point_cache_at(cache_dir: Path) -> None:
    """Inductor's on-disk caches (FX graphs, AOT autograd, kernels) live under `cache_dir` from now on, for
    this process (inductor reads the variable at every cache access)."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    os.environ[INDUCTOR_CACHE_ENV] = str(cache_dir)


def warm_passes(runner: Compilable) -> dict[Bucket, list[ForwardItem]]:
    """One decode pass per bucket the runner's thread policy uses: 1 sequence, 2, and the larger of 16 and
    the smallest multi-thread pass. Start-up only: their K/V writes land in blocks no sequence owns yet."""
    num_blocks = runner.kv_caches[0][0].shape[0]
    passes: dict[Bucket, list[ForwardItem]] = {}
    for num_seqs in (1, 2, BATCH_WARM_SEQS):
        if num_seqs == BATCH_WARM_SEQS and runner.threads is not None:
            num_seqs = max(num_seqs, runner.threads.single_thread_max_tokens + 1)
        items = [ForwardItem([0], runner.block_size - 1, [i % num_blocks], num_logits=1) for i in range(num_seqs)]
        passes.setdefault(runner.bucket_of(num_seqs), items)
    return passes


def compile_runner(runner: Compilable[C], mode: CompileMode, name: str) -> CompileStats:
    """Compile `runner`'s dense path and decide, per bucket, whether to use it (see the module's docstring).
    Never raises for a compilation failure: the runner then stays eager."""
    stats = CompileStats()
    runner.compile_stats = stats
    if mode is CompileMode.OFF:
        return stats
    start_s = time.perf_counter()
    passes = warm_passes(runner)
    try:
        compiled = runner.new_compiled()
        with compiled.compiling():
            for items in passes.values():
                runner.forward_with(items, compiled)
    except Exception:
        log.exception("compiling the %s model failed: it runs eager", name)
        stats.record_failure()
        return stats
    stats.compile_time_s = time.perf_counter() - start_s
    runner.compiled = compiled
    for bucket, items in passes.items():
        if mode is CompileMode.ON:
            stats.is_compiled[bucket.value] = True
            continue
        comparison, _ = time_interleaved(_eager_or_compiled(runner, compiled, items))
        stats.eager_ms[bucket.value], stats.compiled_ms[bucket.value] = comparison.base_ms, comparison.variant_ms
        stats.verdicts[bucket.value] = comparison.verdict.value
        stats.is_compiled[bucket.value] = comparison.verdict is Verdict.FASTER
    log.info(
        "%s model compiled in %.1f s; compiled buckets: %s (eager ms %s, compiled ms %s)", name,
        stats.compile_time_s, [b for b, on in stats.is_compiled.items() if on] or "none", stats.eager_ms,
        stats.compiled_ms,
    )
    return stats


def _eager_or_compiled(runner: Compilable[C], compiled: C, items: list[ForwardItem]) -> Callable[[bool], torch.Tensor]:
    """One forward of `items`: compiled for True, eager for False."""
    return lambda is_compiled: runner.forward_with(items, compiled if is_compiled else None)
