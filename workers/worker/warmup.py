"""Warm-up: before a worker says it is ready, run the engine over every path a first job would otherwise pay
for cold (allocator growth, first-call dispatch, oneDNN primitive creation, inductor guards).

First every runner's pass shapes (Engine.warm_pass_shapes: one pass of each token count up to
`warm_pass_tokens`, so oneDNN's per-shape set-up is paid here, not by the steps of the first jobs). Then
passes through the engine's public API only (add_request / step), with prompts from the engine's tokenizer:
- prefill: one prompt longer than `max_num_batched_tokens` when the model allows it (chunked prefill), one short;
- decode at batch 1, greedy and sampled (a seeded request: the rejection sampler's path), with the engine's
  default speculation (draft or n-gram), and one request with speculation off;
- every batch bucket of the thread policy: 2 sequences, then the larger of 16 and the smallest multi-thread
  pass (workers/engine/compilation.py `warm_passes`), capped at max_num_seqs: the same buckets start-up
  compilation compiled, now run end to end (schedule -> draft -> verify -> apply).
The worker heartbeats, and so `/readyz` turns ready, only after this returns (workers/worker/main.py).
Its requests never touch Redis; they are counted in the engine's speculation statistics like any other.
"""

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from shared.speculation import SpeculativeMethod
from workers.engine.compilation import BATCH_WARM_SEQS
from workers.engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)

WARM_TEXT = "def warm_up(self, value):\n    return [value for _ in range(3)]\n"
NEW_TOKENS = 8  # per warm-up request: enough decode steps for speculation to propose and verify


@dataclass
class WarmupReport:
    duration_s: float = 0.0
    shapes_s: float = 0.0  # of which warming the pass shapes (Engine.warm_pass_shapes)
    num_requests: int = 0
    batch_sizes: list[int] = field(default_factory=list)  # concurrent requests of each pass


def _prompt(engine: Any, num_tokens: int) -> list[int]:
    """Token ids of about `num_tokens` (repeated WARM_TEXT), inside the model's context with room to decode."""
    ids = list(engine.tokenizer.encode(WARM_TEXT, add_special_tokens=False)) or [0]
    limit = max(1, min(num_tokens, engine.max_model_len - NEW_TOKENS - 1))
    return (ids * (limit // len(ids) + 1))[:limit]


def _run(engine: Any, requests: list[tuple[list[int], SamplingParams]], tag: str) -> None:
    """Add the requests and step the engine until each has finished."""
    pending = set()
    for i, (prompt, params) in enumerate(requests):
        request_id = f"warmup-{tag}-{i}"
        engine.add_request(request_id, prompt, params)
        pending.add(request_id)
    while pending:
        for out in engine.step():
            if out.finished:
                pending.discard(out.request_id)


def warm_up(engine: Any) -> WarmupReport:
    """Run the warm-up passes on `engine` (see the module's docstring) -> what it ran and how long it took."""
    start_s = time.perf_counter()
    cfg = engine.cfg
    greedy = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    sampled = SamplingParams(max_tokens=NEW_TOKENS, temperature=1.0, seed=0, ignore_eos=True)
    plain = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True,
                           speculative=SpeculativeMethod.NONE)
    report = WarmupReport(shapes_s=engine.warm_pass_shapes())
    passes: list[tuple[str, list[tuple[list[int], SamplingParams]]]] = [
        ("prefill", [(_prompt(engine, cfg.max_num_batched_tokens + 16), greedy)]),
        ("greedy", [(_prompt(engine, 16), greedy)]),
        ("sampled", [(_prompt(engine, 16), sampled)]),
        ("plain", [(_prompt(engine, 16), plain)]),
    ]
    batch_seqs = max(BATCH_WARM_SEQS, cfg.single_thread_max_tokens + 1)
    for num_seqs in sorted({min(2, cfg.max_num_seqs), min(batch_seqs, cfg.max_num_seqs)}):
        if num_seqs > 1:
            passes.append((f"batch{num_seqs}", [(_prompt(engine, 8 + i), greedy) for i in range(num_seqs)]))
    for tag, requests in passes:
        _run(engine, requests, tag)
        report.num_requests += len(requests)
        report.batch_sizes.append(len(requests))
    report.duration_s = time.perf_counter() - start_s
    log.info("warm-up: pass shapes in %.2f s, %d requests (batches %s), %.2f s in all", report.shapes_s,
             report.num_requests, report.batch_sizes, report.duration_s)
    return report
