"""Speculation under a JSON schema, inside `specfleet bench spec`: constrained greedy decoding with speculation
(draft chain, n-gram, EAGLE chain) against constrained plain decoding, on the same engines the spec bench
built, each batch size running every variant in turn; and the validity of seeded sampled constrained output
over many runs (SAMPLED_SCHEMA, bounded so every answer closes; checked with jsonschema_rs when it is
installed, else as JSON with the schema's keys).

Rows: `json_<variant>` with tokens/s (tokens actually emitted: a constrained answer may close before
max_tokens), τ, greedy match against `json_plain`, and the share of answers that parse as JSON.
"""

import dataclasses
import json
import time
from typing import Any

from shared.response_format import ResponseFormat, grammar_of
from workers.bench.engine_bench import match_rate
from workers.engine.engine import Engine
from workers.engine.sampling_params import SamplingParams

# long strings and a list: the answer runs for many tokens, so speculation has something to speed up
GREEDY_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "code": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "code", "tags"],
}
SAMPLED_SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "kind": {"enum": ["def", "class", "import"]},
        "line": {"type": "integer", "minimum": 0, "maximum": 999},
    },
    "required": ["ok", "kind", "line"],
    "additionalProperties": False,
}
VARIANTS = ("plain", "sd_draft_chain", "sd_ngram", "sd_eagle_chain")


def _grammar(schema: dict[str, Any]) -> str:
    grammar = grammar_of(ResponseFormat.model_validate({"type": "json_schema", "json_schema": {"name": "b", "schema": schema}}))
    assert grammar is not None
    return grammar


def _run(engine: Engine, prompts: list[list[int]], params: list[SamplingParams]) -> tuple[float, list[list[int]], list[str]]:
    """All at once; (seconds, tokens per request, text per request)."""
    ids = [f"j{i}" for i in range(len(prompts))]
    generated: dict[str, list[int]] = {rid: [] for rid in ids}
    texts: dict[str, str] = {rid: "" for rid in ids}
    start = time.perf_counter()
    for rid, prompt, p in zip(ids, prompts, params, strict=True):
        engine.add_request(rid, prompt, p)
    while engine.num_unfinished():
        for out in engine.step():
            generated[out.request_id].extend(out.new_token_ids)
            texts[out.request_id] += out.new_text
    return time.perf_counter() - start, [generated[r] for r in ids], [texts[r] for r in ids]


def _parses(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


def bench_grammar(
    engines: dict[str, Engine], prompts: list[list[int]], batch_sizes: tuple[int, ...], num_bs1_prompts: int,
    num_new_tokens: int, num_sampled_runs: int,
) -> tuple[list[dict[str, Any]], dict[str, float]]:
    grammar = _grammar(GREEDY_SCHEMA)
    variants = [v for v in VARIANTS if v in engines]
    rows: list[dict[str, Any]] = []
    tps: dict[tuple[str, int], float] = {}
    outputs: dict[tuple[str, int], list[list[int]]] = {}
    for batch in batch_sizes:
        used = prompts[:num_bs1_prompts] if batch == 1 else [prompts[i % len(prompts)] for i in range(batch)]
        for name in variants:
            engine = engines[name]
            before = dataclasses.replace(engine.speculator.stats.counts)
            params = [SamplingParams(max_tokens=num_new_tokens, temperature=0.0, grammar=grammar) for _ in used]
            outs: list[list[int]] = []
            texts: list[str] = []
            if batch == 1:  # one after another
                seconds = 0.0
                for p, sp in zip(used, params, strict=True):
                    s, o, t = _run(engine, [p], [sp])
                    seconds, outs, texts = seconds + s, outs + o, texts + t
            else:
                seconds, outs, texts = _run(engine, used, params)
            counts = engine.speculator.stats.counts
            steps = counts.num_steps - before.num_steps
            tps[(name, batch)] = sum(len(o) for o in outs) / seconds
            outputs[(name, batch)] = outs
            rows.append({
                "system": f"json_{name}", "batch": batch, "tokens_per_s": tps[(name, batch)],
                "tau": (counts.num_emitted - before.num_emitted) / steps if steps else 1.0,
                "match_vs_plain": match_rate(outs, outputs[("plain", batch)]) if name != "plain" else 1.0,
                "json_valid": sum(_parses(t) for t in texts) / len(texts),
            })  # fmt: skip
    ratios = {
        f"json_schema_{name.removeprefix('sd_')}_vs_plain_bs{b}": tps[(name, b)] / tps[("plain", b)]
        for name in variants if name != "plain" for b in batch_sizes
    }
    ratios["json_schema_min_greedy_match_vs_plain"] = min(
        r["match_vs_plain"] for r in rows if r["system"] != "json_plain"
    )
    valid, checked = sampled_validity(engines.get("sd_draft_chain") or engines["plain"], prompts, num_sampled_runs)
    rows.append({"system": "json_sampled_sd_draft_chain", "batch": checked, "schema_valid": valid / checked})
    ratios["json_schema_sampled_valid"] = valid / checked
    return rows, ratios


def sampled_validity(engine: Engine, prompts: list[list[int]], num_runs: int) -> tuple[int, int]:
    """(answers valid against SAMPLED_SCHEMA, runs): seeds 0 .. num_runs - 1 at temperature 1, 64 at a time."""
    grammar = _grammar(SAMPLED_SCHEMA)
    is_valid = _validator(SAMPLED_SCHEMA)
    valid = 0
    for first in range(0, num_runs, 64):
        seeds = range(first, min(first + 64, num_runs))
        params = [SamplingParams(max_tokens=64, temperature=1.0, seed=s, grammar=grammar) for s in seeds]
        _, _, texts = _run(engine, [prompts[s % len(prompts)] for s in seeds], params)
        valid += sum(is_valid(t) for t in texts)
    return valid, num_runs


def _validator(schema: dict[str, Any]) -> Any:
    try:
        import jsonschema_rs  # a dev dependency (through schemathesis)
    except ImportError:
        return lambda text: _parses(text) and set(json.loads(text)) == set(schema["required"])
    validator = jsonschema_rs.validator_for(schema)
    return lambda text: _parses(text) and validator.is_valid(json.loads(text))
