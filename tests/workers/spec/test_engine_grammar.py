"""Structured output under speculative decoding, on the one-layer tiny target in float64 (eagle_models: a
close draft and a near-copy EAGLE head): greedy constrained output is token-identical with speculation on
(draft chain, n-gram, EAGLE chain, trees configured) and off, and always follows its schema; seeded sampled
constrained output always follows its schema (SAMPLED_RUNS per method here; `specfleet bench spec`
checks 1,000);
a grammar that does not compile is refused."""

import json
from pathlib import Path

import jsonschema_rs
import pytest

from shared.response_format import JsonSchemaFormat, ResponseFormat, grammar_of
from tests.workers.engine_runs import run_all, spec_engine, tokens
from tests.workers.spec.test_engine_speculation import make_prompts
from workers.engine.errors import InvalidRequestError
from workers.engine.sampling_params import SamplingParams

# a bounded schema: every answer closes within a few dozen tokens, so a run cut at max_tokens is a real failure
BOUNDED = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["ok", "color", "n"],
    "additionalProperties": False,
}
# an open one (strings, arrays): greedy runs are compared token by token even where max_tokens cuts them
OPEN = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}}},
    "required": ["name"],
}
SAMPLED_RUNS = 16
FREE = "free"  # the unconstrained request of each greedy batch
METHODS = {
    "none": dict(speculative_method="none"),
    "draft-chain": dict(speculative_method="draft"),
    "draft-tree-configured": dict(speculative_method="draft", tree_size=6, tree_branching=2),
    "ngram": dict(speculative_method="ngram", is_adaptive=False),
    "eagle-chain": dict(speculative_method="eagle", eagle="copy_head"),
    # even ids only: where the grammar takes no even token, the chain ends (draw_chain_step)
    "eagle-draft-vocab": dict(speculative_method="eagle", eagle="vocab_head", is_adaptive=False),
}


def grammar(schema: dict) -> str:
    fmt = ResponseFormat(type="json_schema", json_schema=JsonSchemaFormat(name="t", schema=schema))
    out = grammar_of(fmt)
    assert out is not None
    return out


def engine_for(eagle_models: dict[str, Path], method: str, **overrides):
    cfg = dict(METHODS[method]) | overrides
    eagle = cfg.pop("eagle", None)
    return spec_engine(eagle_models, draft="close_draft", eagle=eagle, **cfg)


def greedy_requests(schema: dict, max_tokens: int = 48) -> dict[str, tuple[list[int], SamplingParams]]:
    """Constrained requests, and one free request in the same batch (it must not feel the others' grammar)."""
    g = grammar(schema)
    requests = {str(i): (p, SamplingParams(max_tokens=max_tokens, temperature=0.0, grammar=g))
                for i, p in enumerate(make_prompts()[::10])}
    requests[FREE] = (make_prompts()[1], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    return requests


@pytest.fixture(scope="module")
def plain(eagle_models: dict[str, Path]) -> dict[str, dict[str, list[int]]]:
    """schema name -> request id -> the tokens constrained plain decoding gives."""
    engine = engine_for(eagle_models, "none")
    return {
        name: {rid: tokens(o) for rid, o in run_all(engine, greedy_requests(schema)).items()}
        for name, schema in (("bounded", BOUNDED), ("open", OPEN))
    }


@pytest.mark.parametrize("method", [m for m in METHODS if m != "none"])
def test_greedy_constrained_output_is_the_same_with_speculation(eagle_models, plain, method) -> None:
    engine = engine_for(eagle_models, method)
    for name, schema in (("bounded", BOUNDED), ("open", OPEN)):
        outs = run_all(engine, greedy_requests(schema))
        assert {rid: tokens(o) for rid, o in outs.items()} == plain[name]
    counts = engine.speculator.stats.counts
    assert counts.num_steps > 0 and counts.num_accepted > 0  # it really drafted under the grammar, and kept some
    assert engine.speculator.stats.num_fallbacks == 0


def test_greedy_constrained_output_follows_its_schema(eagle_models, plain) -> None:
    engine = engine_for(eagle_models, "none")
    validator = jsonschema_rs.validator_for(BOUNDED)
    outs = run_all(engine, greedy_requests(BOUNDED))
    for o in (o for rid, o in outs.items() if rid != FREE):
        assert o[-1].finish_reason == "stop"
        text = "".join(x.new_text for x in o)
        assert validator.is_valid(json.loads(text)), text
    assert {rid: tokens(o) for rid, o in outs.items()} == plain["bounded"]


@pytest.mark.parametrize("method", ["draft-chain", "ngram", "eagle-chain"])
def test_sampled_constrained_output_always_follows_its_schema(eagle_models, method) -> None:
    engine = engine_for(eagle_models, method)
    g = grammar(BOUNDED)
    prompts = make_prompts()
    requests = {
        str(seed): (prompts[seed % len(prompts)], SamplingParams(max_tokens=64, temperature=1.0, seed=seed, grammar=g))
        for seed in range(SAMPLED_RUNS)
    }
    validator = jsonschema_rs.validator_for(BOUNDED)
    for rid, o in run_all(engine, requests).items():
        text = "".join(x.new_text for x in o)
        assert o[-1].finish_reason == "stop", (rid, text)
        assert validator.is_valid(json.loads(text)), (rid, text)


def test_json_object_gives_an_object(eagle_models) -> None:
    engine = engine_for(eagle_models, "draft-chain")
    g = grammar_of(ResponseFormat(type="json_object"))
    outs = run_all(engine, {"a": (make_prompts()[0], SamplingParams(max_tokens=200, temperature=1.0, seed=3, grammar=g))})
    text = "".join(x.new_text for x in outs["a"])
    assert text.startswith("{")
    if outs["a"][-1].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)


def test_a_grammar_that_does_not_compile_is_refused(eagle_models) -> None:
    engine = engine_for(eagle_models, "none")
    with pytest.raises(InvalidRequestError) as err:
        engine.add_request("bad", make_prompts()[0], SamplingParams(grammar='{"grammars": [{"json_schema": 1}]}'))
    assert err.value.field == "response_format"
    assert engine.num_unfinished() == 0


def test_a_resumed_request_continues_its_grammar(eagle_models, plain) -> None:
    """A job resumed on another worker sends prompt + its output so far; the grammar continues after it."""
    engine = engine_for(eagle_models, "draft-chain")
    prompt = make_prompts()[0]
    done = plain["bounded"]["0"]
    g = grammar(BOUNDED)
    params = SamplingParams(max_tokens=48 - 5, temperature=0.0, grammar=g, num_resumed_tokens=5)
    out = run_all(engine, {"r": (prompt + done[:5], params)})["r"]
    assert done[:5] + tokens(out) == done


STRUCTURED = {  # vLLM's structured_outputs: how each answer must read
    "choice": ({"choice": ["yes", "no", "maybe so", 'a "quoted"\nline']}, None),
    "escaped": ({"choice": ['say "hi"\n\\ü']}, None),  # one string: JSON's escapes read as Lark's
    "regex": ({"regex": r"[0-9]{3}-[a-z]{2,4}"}, r"[0-9]{3}-[a-z]{2,4}"),
    "grammar": ({"grammar": 'start: "(" item ("," item)* ")"\nitem: /[a-c]/'}, r"\([a-c](,[a-c])*\)"),
}


@pytest.mark.parametrize("method", ["none", "draft-chain", "ngram", "eagle-chain"])
def test_structured_outputs_regex_choice_and_lark_grammars(eagle_models, method) -> None:
    """A regex, a choice and a Lark grammar (shared/response_format.py StructuredOutputs) constrain the answer as
    a JSON schema does: greedy and seeded sampled answers match, and greedy ones are the same with speculation."""
    import re

    from shared.response_format import StructuredOutputs

    engine = engine_for(eagle_models, method)
    requests = {}
    for name, (spec, _) in STRUCTURED.items():
        g = StructuredOutputs.model_validate(spec).compiled()
        for i in range(3):
            params = SamplingParams(max_tokens=48, temperature=0.0 if i == 0 else 1.0, seed=i, grammar=g)
            requests[f"{name}-{i}"] = (make_prompts()[i * 7], params)
    outs = run_all(engine, requests)
    for rid, o in outs.items():
        name = rid.rsplit("-", 1)[0]
        text = "".join(x.new_text for x in o)
        spec, pattern = STRUCTURED[name]
        assert o[-1].finish_reason == "stop", (rid, text)
        assert text in spec["choice"] if pattern is None else re.fullmatch(pattern, text), (rid, text)
    greedy = {rid: tokens(o) for rid, o in outs.items() if rid.endswith("-0")}
    plain = run_all(engine_for(eagle_models, "none"), {rid: requests[rid] for rid in greedy})
    assert greedy == {rid: tokens(o) for rid, o in plain.items()}
