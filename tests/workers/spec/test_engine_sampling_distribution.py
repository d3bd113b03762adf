"""Model-level check that speculative sampling is lossless: the engine's (t1, t2) pairs follow the target.

t1 comes from the prefill; t2 goes through rejection sampling against a partly agreeing draft (k = 2).
Their joint distribution is computed exactly from the reference model (transformers, float64) with the same
temperature/top-k transform, and the engine's samples are compared with it by a chi-square test.
"""

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from workers.engine.config import EngineConfig
from workers.engine.engine import Engine
from workers.engine.sampling_params import SamplingParams
from workers.spec.distributions import logits_to_probs

NUM_SAMPLES = 3000
TEMPERATURE, TOP_K = 0.7, 6
PROMPT = [17, 300, 42, 99, 5]


def transform(logits: torch.Tensor) -> torch.Tensor:  # [n, V] -> [n, V]
    n = logits.shape[0]
    return logits_to_probs(logits, torch.full((n,), TEMPERATURE), torch.full((n,), TOP_K), torch.ones(n))


def processed(logits: torch.Tensor, outputs: list[list[int]], rules: dict[str, Any] | None) -> torch.Tensor:
    """[n, V] each row after its output so far, under a request's logit_bias and presence/frequency penalties
    written out as OpenAI defines them (before temperature and top-k)."""
    if not rules:
        return logits
    out = logits.clone()
    for row, output in enumerate(outputs):
        for token, bias in (rules.get("logit_bias") or {}).items():
            out[row, token] += bias
        for token in set(output):
            out[row, token] -= rules.get("frequency_penalty", 0.0) * output.count(token) + rules.get("presence_penalty", 0.0)
    return out


def exact_joint(target_dir: Path, rules: dict[str, Any] | None = None) -> dict[tuple[int, int], float]:
    model = transformers.AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float64).eval()
    with torch.no_grad():
        p1 = transform(processed(model(torch.tensor([PROMPT])).logits[0, -1:], [[]], rules).float())[0]  # [V]
        firsts = p1.nonzero().flatten().tolist()
        second_inputs = torch.tensor([PROMPT + [t] for t in firsts])  # [F, len + 1]
        p2 = transform(processed(model(second_inputs).logits[:, -1], [[t] for t in firsts], rules).float())  # [F, V]
    return {
        (t1, t2): float(p1[t1] * p2[i, t2])
        for i, t1 in enumerate(firsts)
        for t2 in p2[i].nonzero().flatten().tolist()
    }


def chi_square_p_value(observed: list[int], expected: list[float]) -> float:
    """Goodness of fit, bins with expected count < 5 pooled."""
    obs, exp, pool_o, pool_e = [], [], 0.0, 0.0
    for o, e in zip(observed, expected, strict=True):
        if e < 5:
            pool_o, pool_e = pool_o + o, pool_e + e
        else:
            obs.append(o)
            exp.append(e)
    if pool_e > 0:
        obs.append(pool_o)
        exp.append(pool_e)
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp, strict=True))
    dof = len(obs) - 1
    return float(
        torch.special.gammaincc(
            torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64)
        )
    )


def test_speculative_sampling_follows_the_target_distribution(spec_models: dict[str, Path]) -> None:
    cfg = EngineConfig(
        dtype="float64",
        kv_cache_mb=64,
        block_size=4,
        max_num_seqs=128,
        speculative_method="draft",
        is_adaptive=False,
        num_speculative_tokens=2,
    )
    check_samples_follow_the_target(Engine(cfg, spec_models["target"], spec_models["close_draft"]), spec_models["target"])


# t2's position pays for t1 (penalties) and both feel the bias: rows that differ within one draft chain
RULES = {"frequency_penalty": 1.5, "presence_penalty": 0.5, "logit_bias": {42: 1.5, 99: -2.0}}


@pytest.mark.parametrize("method", ["draft", "eagle"])
def test_sampling_under_bias_and_penalties_follows_the_target(
    spec_models: dict[str, Path], eagle_models: dict[str, Path], method: str
) -> None:
    """logit_bias and penalties (workers/engine/target_logits.py) under rejection sampling: the pairs follow the
    target's processed distribution, the penalties counting t1 at t2's row, whichever proposer drafted t2 (and
    applied the rules to its own rows: ProposerRules)."""
    cfg = EngineConfig(
        dtype="float64", kv_cache_mb=64, block_size=4, max_num_seqs=128, speculative_method=method,
        is_adaptive=False, num_speculative_tokens=2,
    )  # fmt: skip
    if method == "draft":
        engine = Engine(cfg, spec_models["target"], spec_models["close_draft"])
        target = spec_models["target"]
    else:
        engine = Engine(cfg, eagle_models["target"], None, eagle_models["copy_head"])
        target = eagle_models["target"]
    check_samples_follow_the_target(engine, target, rules=RULES)


@pytest.mark.parametrize("tree_size", [0, 4])
def test_eagle_sampling_follows_the_target_distribution(eagle_models: dict[str, Path], tree_size: int) -> None:
    """The same check with an EAGLE head proposing: a chain of 2 (rejection sampling against the head's q),
    or a 4-node tree (children drawn without replacement, recursive rejection sampling)."""
    check_eagle_samples(eagle_models["target"], eagle_models["copy_head"], tree_size)


@pytest.mark.parametrize("tree_size", [0, 4])
def test_a_draft_vocabulary_keeps_sampling_exact(
    eagle_models: dict[str, Path], tree_size: int, tmp_path: Path
) -> None:
    """A head whose draft vocabulary lacks every other token t2 can be (by id, over every t1): its q is zero on
    them, so only the residual distribution gives them, and the pairs must still follow the target."""
    from workers.demo.tiny import TINY_VOCAB, make_copy_head

    support = sorted({t2 for _, t2 in exact_joint(eagle_models["target"])})
    lacking = set(support[::2])
    vocab = [t for t in range(TINY_VOCAB) if t not in lacking]
    head = make_copy_head(eagle_models["target"], tmp_path / "head", draft_vocab=vocab)
    check_eagle_samples(eagle_models["target"], head, tree_size)


def check_eagle_samples(target_dir: Path, head_dir: Path, tree_size: int) -> None:
    cfg = EngineConfig(
        dtype="float64", kv_cache_mb=64, block_size=4, max_num_seqs=128, speculative_method="eagle",
        is_adaptive=False, num_speculative_tokens=2, tree_size=tree_size,
    )  # fmt: skip
    engine = Engine(cfg, target_dir, None, head_dir)
    # a tree needs room for its 4 nodes after t1: 6 tokens; only (t1, t2) is compared
    check_samples_follow_the_target(engine, target_dir, max_tokens=6 if tree_size else 3)
    counts = engine.speculator.stats.counts
    if tree_size:  # trees really were drafted: more nodes a step than a 2-token chain has
        assert counts.num_drafted > 2 * counts.num_steps


def check_samples_follow_the_target(
    engine: Engine, target_dir: Path, max_tokens: int = 3, rules: dict[str, Any] | None = None
) -> None:
    generated: dict[str, list[int]] = {}
    for i in range(NUM_SAMPLES):
        params = SamplingParams(
            max_tokens=max_tokens, temperature=TEMPERATURE, top_k=TOP_K, seed=10_000 + i, ignore_eos=True,
            **(rules or {}),
        )
        engine.add_request(str(i), PROMPT, params)
        generated[str(i)] = []
    while engine.num_unfinished():
        for out in engine.step():
            generated[out.request_id].extend(out.new_token_ids)
    counts = engine.speculator.stats.counts
    assert counts.num_steps >= NUM_SAMPLES and 0.1 < counts.acceptance_rate < 0.95  # t2 really was verified

    joint = exact_joint(target_dir, rules)
    pairs = [(g[0], g[1]) for g in generated.values()]
    assert set(pairs) <= set(joint)  # never a pair the target cannot produce
    keys = sorted(joint)
    observed = [pairs.count(k) for k in keys]
    expected = [joint[k] * NUM_SAMPLES for k in keys]
    assert chi_square_p_value(observed, expected) > 1e-4
