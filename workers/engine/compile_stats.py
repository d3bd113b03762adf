"""What a runner compiled and uses, per shape bucket (set at start-up by workers/engine/compilation.py)."""

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TypeVar

import torch

log = logging.getLogger(__name__)

C = TypeVar("C")  # a compiled dense path (workers/models/compiled.py)
R = TypeVar("R")


class CompileMode(StrEnum):
    AUTO = "auto"  # compile at start-up, use it where it measured faster on this host
    ON = "on"
    OFF = "off"


class Bucket(StrEnum):
    """Shape buckets, one compiled graph each. A graph is specialised to one token (dynamo specialises size 1)
    or dynamic over the token count, and to the torch thread count it was compiled under (inductor's kernels
    are built for it, and dynamo guards on it): the runner's thread policy runs small passes on one thread."""

    DECODE = "decode"  # passes of one token (batch-1 decode, every draft token): one thread
    SMALL = "small"  # 2 .. single_thread_max_tokens tokens: one thread
    BATCH = "batch"  # every larger pass: all threads

    @classmethod
    def of(cls, num_tokens: int, single_thread_max_tokens: int) -> "Bucket":
        if num_tokens == 1:
            return cls.DECODE
        return cls.SMALL if num_tokens <= single_thread_max_tokens else cls.BATCH


@dataclass
class CompileStats:
    """One runner's compilation: what it uses, what it cost, what it measured."""

    is_compiled: dict[str, bool] = field(default_factory=lambda: {b.value: False for b in Bucket})  # bucket -> in use
    compile_time_s: float = 0.0  # building and warming every bucket at start-up
    eager_ms: dict[str, float] = field(default_factory=dict)  # bucket -> median forward ms (auto only)
    compiled_ms: dict[str, float] = field(default_factory=dict)  # bucket -> median forward ms (auto only)
    # bucket -> the compiled forward against the eager one, over paired passes (auto only; interleaved.Verdict)
    verdicts: dict[str, str] = field(default_factory=dict)
    num_failures: int = 0  # compilations or compiled forwards that raised and fell back to eager

    def uses_compiled(self, bucket: Bucket) -> bool:
        return self.is_compiled[bucket.value]

    def record_failure(self) -> None:
        """A compilation or a compiled forward raised: every bucket runs eager from now on."""
        self.num_failures += 1
        self.is_compiled = {b.value: False for b in Bucket}


def run_compiled_or_eager(
    stats: CompileStats, bucket: Bucket, compiled: C | None, run: Callable[[C | None], R], what: str
) -> R:
    """`run(compiled)` where `stats` says this bucket is compiled, else `run(None)` (eager). A compiled run that
    raises (or would recompile: start-up compiled every bucket) is logged and counted, every bucket runs eager
    from then on, and this one reruns eager (a pass rewrites the same K/V slots)."""
    if compiled is None or not stats.uses_compiled(bucket):
        return run(None)
    try:
        with torch.compiler.set_stance("fail_on_recompile"):
            return run(compiled)
    except Exception:
        log.exception("compiled %s failed: this model runs eager from now on", what)
        stats.record_failure()
        return run(None)
