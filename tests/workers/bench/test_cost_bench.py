"""The cost benchmark's measurement on a real engine (tiny pair): every generated token is counted, and the
engine time charged per 1,000 tokens is priced at the given rate."""

from pathlib import Path

import pytest

from workers.bench.cost_bench import NEW_TOKENS, _run
from workers.engine.config import EngineConfig
from workers.engine.engine import Engine


def test_cost_per_1k_tokens_sd_on_and_off(tiny_pair: tuple[Path, Path]) -> None:
    target, draft = tiny_pair
    engine = Engine(EngineConfig(target_dir=str(target), kv_cache_mb=16, max_num_seqs=4, num_threads=1), target,
                    draft)
    prompts = ["def f(x):", "import os", "class A:"]
    for speculative in (True, False):
        row = _run(engine, prompts, concurrency=2, speculative=speculative, price=3600.0)  # 1 a second
        assert row["tokens"] == len(prompts) * NEW_TOKENS and row["speculation"] == ("on" if speculative else "off")
        assert row["compute_s_per_1k"] > 0
        assert row["cost_per_1k"] == pytest.approx(row["compute_s_per_1k"], rel=1e-3)
    assert engine.num_unfinished() == 0
