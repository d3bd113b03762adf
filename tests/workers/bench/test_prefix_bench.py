"""The prefix benchmark's measurement on a real engine (tiny pair, blocks of 16 tokens): requests after a shared
system prompt and chats' turns (one conversation, and three at once) take cached blocks on the cached engine, none
on the other, and answer alike."""

from pathlib import Path

from workers.bench.prefix_bench import _chats, _requests
from workers.engine.config import EngineConfig
from workers.engine.engine import Engine

SYSTEM = "You are a careful Python reviewer. Answer with code only.\n" * 8


def test_cached_and_uncached_runs_answer_alike_and_say_what_they_took(tiny_pair: tuple[Path, Path]) -> None:
    target, _ = tiny_pair
    runs = {}
    for flag in (False, True):
        engine = Engine(EngineConfig(target_dir=str(target), kv_cache_mb=16, max_num_seqs=4, num_threads=1,
                                     speculative_method="none", prefix_caching=flag), target)  # fmt: skip
        prompts = [SYSTEM + p for p in ("def f(x):", "import os", "class A:", "for i in")]
        one_by_one = _requests(engine, prompts, 1, "a")
        chat = _chats(engine, engine.tokenizer, [SYSTEM], ["def g():", "print(1)", "x = 2"], "c")
        chats = _chats(engine, engine.tokenizer, [f"# {i}\n{SYSTEM}" for i in range(3)], ["def g():", "x = 2"], "d")
        assert len(chats["answers"]) == 6
        runs[flag] = (one_by_one, chat, chats)
        assert engine.num_unfinished() == 0
    for off, on in zip(runs[False], runs[True], strict=True):
        assert on["answers"] == off["answers"] and off["cached_tokens"] == 0
        assert 0 < on["cached_tokens"] < on["prompt_tokens"] == off["prompt_tokens"]
        assert len(on["ttft_ms"]) == len(on["answers"]) and on["tokens"] == off["tokens"] > 0
