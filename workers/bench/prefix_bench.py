"""`specfleet bench prefix [--quick] [--json PATH]`: prefix caching (workers/engine/prefix_cache.py) against the
same engine without it, on the demo pair, in one run.

Two workloads, each run on both engines in turn (cache off, then on, a round at a time, so a noisy host weighs
on both alike), greedy, the engine's default speculation:

- `system_prompt`: one long shared system prompt (held-out code, ~1,200 tokens) before each request's own short
  prompt; one request after another (closed loop, concurrency 1), then all of them at once (concurrency 16).
- `chat`: a conversation of turns, each prompt the previous prompt, its answer and a new user message; one
  conversation (concurrency 1), then 16 at once, each with an opening of its own (concurrency 16: where
  speculation does not pay, an EAGLE engine's head takes in no prompt, and its sequences claim cached blocks
  through the target's features the engine keeps: workers/engine/feature_store.py).

Figures: TTFT p50 (the engine's own: arrival -> first token), tokens/s, the share of prompt tokens taken from the
cache, and whether each answer equals the uncached engine's (greedy: it must). Ratios: cached over uncached.
"""

import dataclasses
import statistics
import time
from typing import Any

import typer

from workers.bench.report import format_table, machine_info, write_json

NEW_TOKENS = 16


def _requests(engine: Any, prompts: list[str] | list[list[int]], concurrency: int, tag: str) -> dict[str, Any]:
    """Run `prompts` with `concurrency` in flight -> TTFTs, tokens, prompt tokens, cached tokens, answers."""
    from workers.engine.sampling_params import SamplingParams

    todo: list[tuple[int, str | list[int]]] = list(enumerate(prompts))
    answers: dict[int, list[int]] = {}
    ttft_ms, num_prompt, num_cached, num_tokens, in_flight = [], 0, 0, 0, 0
    start_s = time.perf_counter()
    while todo or in_flight:
        while todo and in_flight < concurrency:
            i, prompt = todo.pop(0)
            engine.add_request(f"{tag}-{i}", prompt, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))
            answers[i] = []
            in_flight += 1
        for out in engine.step():
            i = int(out.request_id.rsplit("-", 1)[1])
            answers[i] += out.new_token_ids
            num_tokens += len(out.new_token_ids)
            if out.finished:
                in_flight -= 1
                ttft_ms.append(out.metrics["ttft_ms"])
                num_prompt += out.num_prompt_tokens
                num_cached += out.num_cached_tokens
    return {"ttft_ms": ttft_ms, "seconds": time.perf_counter() - start_s, "tokens": num_tokens,
            "prompt_tokens": num_prompt, "cached_tokens": num_cached, "answers": [answers[i] for i in sorted(answers)]}  # fmt: skip


def _chats(engine: Any, tokenizer: Any, openings: list[str], messages: list[str], tag: str) -> dict[str, Any]:
    """Conversations, all in flight at once (one per opening): each turn's prompt is the conversation's last one,
    its answer and the next message (token ids); a conversation's next turn starts the step after its answer."""
    from workers.engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    prompts = [list(tokenizer.encode(opening, add_special_tokens=False)) for opening in openings]
    turn = [0] * len(openings)
    answers: dict[int, list[int]] = {}  # conversation * len(messages) + turn -> its answer
    ttft_ms, num_prompt, num_cached, num_tokens = [], 0, 0, 0

    def start(c: int) -> None:
        prompts[c] = prompts[c] + list(tokenizer.encode("\n" + messages[turn[c]], add_special_tokens=False))
        answers[c * len(messages) + turn[c]] = []
        engine.add_request(f"{tag}-{c}-{turn[c]}", prompts[c], params)

    start_s = time.perf_counter()
    for c in range(len(openings)):
        start(c)
    while engine.num_unfinished():
        for out in engine.step():
            c, t = (int(part) for part in out.request_id.rsplit("-", 2)[1:])
            answers[c * len(messages) + t] += out.new_token_ids
            num_tokens += len(out.new_token_ids)
            if out.finished:
                ttft_ms.append(out.metrics["ttft_ms"])
                num_prompt += out.num_prompt_tokens
                num_cached += out.num_cached_tokens
                prompts[c] = prompts[c] + answers[c * len(messages) + t]
                turn[c] += 1
                if turn[c] < len(messages):
                    start(c)
    return {"ttft_ms": ttft_ms, "seconds": time.perf_counter() - start_s, "tokens": num_tokens,
            "prompt_tokens": num_prompt, "cached_tokens": num_cached, "answers": [answers[i] for i in sorted(answers)]}  # fmt: skip


def _row(workload: str, cache: str, concurrency: int, run: dict[str, Any], reference: dict[str, Any] | None) -> dict[str, Any]:
    return {
        "workload": workload,
        "prefix_cache": cache,
        "concurrency": concurrency,
        "requests": len(run["answers"]),
        "ttft_ms_p50": statistics.median(run["ttft_ms"]),
        "tokens_per_s": run["tokens"] / run["seconds"],
        "cached_share": run["cached_tokens"] / run["prompt_tokens"] if run["prompt_tokens"] else 0.0,
        "match_vs_uncached": 1.0 if reference is None else float(run["answers"] == reference["answers"]),
    }


def bench_prefix_command(quick: bool, json_path: str | None) -> int:
    from workers.demo.corpus import held_out_prompts
    from workers.demo.resolve import with_demo_pair
    from workers.engine.config import EngineConfig
    from workers.engine.engine import Engine

    base = with_demo_pair(EngineConfig.load())
    engines = {flag: Engine.from_config(dataclasses.replace(base, prefix_caching=flag)) for flag in (False, True)}
    num_requests, num_turns, rounds = (8, 4, 1) if quick else (16, 8, 2)
    prompts = held_out_prompts(num_requests + num_turns + 8, max_chars=400)
    system = "\n\n".join(held_out_prompts(24, max_chars=2000)[16:19])[:4000]  # ~1,200 tokens of other modules' code
    own, chat_messages = prompts[:num_requests], prompts[num_requests : num_requests + num_turns]
    runs: dict[tuple[str, int, bool], list[dict[str, Any]]] = {}
    for r in range(rounds):
        for flag in (False, True):  # uncached first in each round; each run starts from an empty cache
            engine = engines[flag]
            for c in (1, 16):
                shared = f"# run {r}-{c}\n{system}\n\n"  # a new system prompt per run: no reuse across runs
                fresh = [shared + p for p in own]
                engine.add_request(f"warm-{r}-{c}-{flag}", shared, _greedy())  # the shared part, computed once
                while engine.num_unfinished():
                    engine.step()
                runs.setdefault(("system_prompt", c, flag), []).append(_requests(engine, fresh, c, f"s{r}{c}{flag}"))
            for c in (1, 16):  # conversations in flight, each its own opening (no block shared across them)
                openings = [f"# chat {r}-{c}-{i}\n{system[:1500]}" for i in range(c)]
                runs.setdefault(("chat", c, flag), []).append(
                    _chats(engine, engine.tokenizer, openings, chat_messages, f"c{r}{c}{flag}")
                )
    rows, ratios = [], {}
    for workload, c in (("system_prompt", 1), ("system_prompt", 16), ("chat", 1), ("chat", 16)):
        merged = {flag: _merge(runs[(workload, c, flag)]) for flag in (False, True)}
        rows += [_row(workload, "off", c, merged[False], None), _row(workload, "on", c, merged[True], merged[False])]
        on, off = rows[-1], rows[-2]
        ratios[f"prefix_cache_ttft_speedup_{workload}_c{c}"] = off["ttft_ms_p50"] / on["ttft_ms_p50"]
        ratios[f"prefix_cache_tokens_per_s_ratio_{workload}_c{c}"] = on["tokens_per_s"] / off["tokens_per_s"]
        ratios[f"prefix_cache_cached_share_{workload}_c{c}"] = on["cached_share"]
        ratios[f"prefix_cache_match_{workload}_c{c}"] = on["match_vs_uncached"]
    columns = ["workload", "prefix_cache", "concurrency", "requests", "ttft_ms_p50", "tokens_per_s", "cached_share",
               "match_vs_uncached"]  # fmt: skip
    typer.echo(format_table(rows, columns))
    typer.echo("")
    for key, value in ratios.items():
        typer.echo(f"{key}: {value:.3f}")
    if json_path:
        write_json(json_path, "prefix", machine_info(quick=quick, new_tokens=NEW_TOKENS, rounds=rounds), rows, ratios)
    return 0


def _greedy() -> Any:
    from workers.engine.sampling_params import SamplingParams

    return SamplingParams(max_tokens=1, temperature=0.0)


def _merge(runs: list[dict[str, Any]]) -> dict[str, Any]:
    merged: dict[str, Any] = {"ttft_ms": [], "seconds": 0.0, "tokens": 0, "prompt_tokens": 0, "cached_tokens": 0,
                              "answers": []}  # fmt: skip
    for run in runs:
        for key in ("ttft_ms", "answers"):
            merged[key] += run[key]
        for key in ("seconds", "tokens", "prompt_tokens", "cached_tokens"):
            merged[key] += run[key]
    return merged
