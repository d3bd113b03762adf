"""row_distributions: one (temperature, min-p, top-k, top-p) transform for target and draft, equal bit for bit to
the two builders it replaced (the target's in verify_batch, the draft's in draft_proposer), copied below, where
min-p is off; with it, equal to a full sort of the row with vLLM's min-p first."""

from dataclasses import dataclass

import pytest
import torch

from workers.spec.distributions import GreedyRows, logits_to_probs, row_distributions


@dataclass
class Params:
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0


def old_target_distributions(logits: torch.Tensor, row_params: list[Params]) -> torch.Tensor:  # [S, V]
    sampling_rows = [i for i, p in enumerate(row_params) if not p.is_greedy]
    if not sampling_rows:
        return logits
    rows = torch.tensor(sampling_rows)
    params = [row_params[i] for i in sampling_rows]
    probs = logits_to_probs(
        logits.index_select(0, rows),
        temperature=torch.tensor([p.temperature for p in params], dtype=torch.float32),
        top_k=torch.tensor([p.top_k for p in params], dtype=torch.long),
        top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32),
    )
    out = logits.clone()
    out[rows] = probs
    return out


def old_draft_distributions(logits: torch.Tensor, params: list[Params], plain_for_greedy: bool) -> torch.Tensor:
    temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32)
    if plain_for_greedy:
        temperature = torch.where(temperature == 0.0, torch.ones_like(temperature), temperature)
    return logits_to_probs(
        logits,
        temperature=temperature,
        top_k=torch.tensor([p.top_k for p in params], dtype=torch.long),
        top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32),
    )


ROWS = {
    "greedy": [Params(temperature=0.0)],
    "temperature": [Params(temperature=0.7), Params(temperature=1.3)],
    "top_k": [Params(temperature=1.0, top_k=5), Params(temperature=0.0, top_k=3)],
    "top_p": [Params(temperature=0.9, top_p=0.8), Params(temperature=1.0, top_p=0.3)],
    "mixed": [
        Params(temperature=0.0),
        Params(temperature=0.8, top_k=7),
        Params(temperature=1.0),
        Params(temperature=1.2, top_p=0.6),
        Params(temperature=0.0, top_p=0.5),
        Params(temperature=0.5, top_k=4, top_p=0.9),
    ],
}


def logits_for(num_rows: int, dtype: torch.dtype) -> torch.Tensor:  # [n, V]
    return torch.randn(num_rows, 50, generator=torch.Generator().manual_seed(num_rows)).to(dtype) * 3


@pytest.mark.parametrize("name", list(ROWS))
def test_the_target_rows_equal_the_old_builder(name: str) -> None:
    params = ROWS[name] * 2
    logits = logits_for(len(params), torch.float32)  # the runner's logits are float32 whatever the model's dtype
    got = row_distributions(logits, params, GreedyRows.LOGITS)
    want = old_target_distributions(logits, params)
    assert torch.equal(got, want)
    if all(p.is_greedy for p in params):
        assert got is logits  # nothing to transform: no copy


@pytest.mark.parametrize("greedy_rows", [GreedyRows.ONE_HOT, GreedyRows.SOFTMAX])
@pytest.mark.parametrize("name", list(ROWS))
def test_the_draft_rows_equal_the_old_builder(name: str, greedy_rows: GreedyRows) -> None:
    params = ROWS[name] * 2
    logits = logits_for(len(params), torch.float32)
    got = row_distributions(logits, params, greedy_rows)
    want = old_draft_distributions(logits, params, plain_for_greedy=greedy_rows is GreedyRows.SOFTMAX)
    assert torch.equal(got, want)


def test_what_greedy_rows_become() -> None:
    params = [Params(temperature=0.0), Params(temperature=1.0)]
    logits = logits_for(2, torch.float32)
    one_hot = row_distributions(logits, params, GreedyRows.ONE_HOT)
    assert one_hot[0].tolist() == torch.nn.functional.one_hot(logits[0].argmax(), 50).float().tolist()
    assert torch.allclose(row_distributions(logits, params, GreedyRows.SOFTMAX)[0], logits[0].softmax(-1))
    kept = row_distributions(logits, params, GreedyRows.LOGITS)
    assert torch.equal(kept[0], logits[0]) and torch.allclose(kept[1], logits[1].softmax(-1))
    assert torch.allclose(one_hot[1], kept[1])  # a sampling row is the same distribution whatever the mode


def sorted_reference(
    logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float = 0.0
) -> torch.Tensor:  # [V]
    """One row through a full sort of its vocabulary: min-p (tokens whose probability is below min_p times the
    likeliest's dropped), the top-k, then the smallest prefix whose mass reaches top_p (the token crossing it
    kept, and always the likeliest)."""
    scaled = logits.float() / temperature  # [V]
    probs = scaled.softmax(dim=-1)  # [V]
    scaled = scaled.masked_fill(probs < min_p * probs.max(), float("-inf"))
    order = scaled.argsort(descending=True)  # [V]
    sorted_logits = scaled[order]
    drop = torch.arange(len(scaled)) >= (top_k if top_k > 0 else len(scaled))
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    drop |= (probs.cumsum(dim=-1) - probs) >= top_p
    drop[0] = False
    kept = torch.full_like(scaled, float("-inf"))
    kept[order] = sorted_logits.masked_fill(drop, float("-inf"))
    return kept.softmax(dim=-1)


@pytest.mark.parametrize("vocab", [300, 4096])
def test_top_k_and_top_p_rank_the_likeliest_tokens_first_and_sort_a_flat_row_whole(vocab) -> None:
    """The candidates-first ranking gives the full sort's distribution: peaked rows settle among their 256
    likeliest tokens, flat ones (top-p reaching past them) are sorted whole, rows without a cut stay whole,
    all in one batch."""
    gen = torch.Generator().manual_seed(vocab)
    cases = [  # (logit scale: peaked or flat, temperature, top_k, top_p)
        (4.0, 1.0, 0, 0.9), (4.0, 0.7, 50, 1.0), (4.0, 1.3, 40, 0.8), (0.05, 1.0, 0, 0.95), (0.05, 1.0, 0, 0.5),
        (1.0, 1.0, 0, 1.0), (1.0, 2.0, 300, 0.99), (8.0, 1.0, 0, 0.999), (1e-3, 1.0, 0, 0.3),
    ]
    logits = torch.stack([torch.randn(vocab, generator=gen) * scale for scale, *_ in cases])  # [n, V]
    logits[1, :10] = float("-inf")  # tokens a grammar refused
    probs = logits_to_probs(
        logits,
        torch.tensor([t for _, t, _, _ in cases]),
        torch.tensor([k for _, _, k, _ in cases]),
        torch.tensor([p for *_, p in cases]),
    )
    for row, (_, temperature, top_k, top_p) in enumerate(cases):
        expected = sorted_reference(logits[row], temperature, top_k, top_p)
        assert torch.equal(probs[row] > 0, expected > 0), row  # the same tokens kept
        torch.testing.assert_close(probs[row], expected, rtol=1e-5, atol=1e-7)


def test_a_row_of_equal_logits_keeps_as_many_tokens_as_top_p_asks() -> None:
    """Which of equal tokens a cut keeps is the ranking's choice (a sort's or topk's); how many is not."""
    vocab = 1000
    probs = logits_to_probs(torch.zeros(1, vocab), torch.ones(1), torch.zeros(1, dtype=torch.long), torch.tensor([0.3]))
    kept = probs[0][probs[0] > 0]
    # 0.3 of the mass: 300 tokens, or 301 where float32's sum of 300 thousandths falls just short of 0.3
    assert len(kept) in (300, 301) and torch.allclose(kept, torch.full_like(kept, 1 / len(kept)))


def test_min_p_drops_the_tokens_below_its_share_of_the_likeliest_before_top_k_and_top_p() -> None:
    vocab = 600
    gen = torch.Generator().manual_seed(11)
    cases = [  # (logit scale, temperature, top_k, top_p, min_p)
        (3.0, 1.0, 0, 1.0, 0.1), (3.0, 0.7, 0, 1.0, 0.01), (0.05, 1.0, 0, 1.0, 0.99), (3.0, 1.0, 20, 1.0, 0.05),
        (3.0, 1.3, 0, 0.5, 0.05), (2.0, 1.0, 5, 0.9, 0.2), (3.0, 1.0, 0, 1.0, 1.0), (3.0, 1.0, 0, 0.9, 0.0),
        (3.0, 0.0, 0, 1.0, 0.5),
    ]
    logits = torch.stack([torch.randn(vocab, generator=gen) * scale for scale, *_ in cases])  # [n, V]
    logits[0, :10] = float("-inf")  # tokens a grammar refused
    probs = logits_to_probs(
        logits,
        torch.tensor([c[1] for c in cases]),
        torch.tensor([c[2] for c in cases]),
        torch.tensor([c[3] for c in cases]),
        torch.tensor([c[4] for c in cases]),
    )
    for row, (_, temperature, top_k, top_p, min_p) in enumerate(cases):
        if temperature == 0.0:  # greedy: min-p never drops the likeliest token
            assert probs[row].argmax() == logits[row].argmax() and probs[row].max() == 1.0
            continue
        expected = sorted_reference(logits[row], temperature, top_k, top_p, min_p)
        assert torch.equal(probs[row] > 0, expected > 0), row  # the same tokens kept
        torch.testing.assert_close(probs[row], expected, rtol=1e-5, atol=1e-7)
    assert int((probs[6] > 0).sum()) == 1  # min_p 1: the likeliest alone
    assert 1 < int((probs[0] > 0).sum()) < vocab  # a cut that keeps some


def test_rows_take_their_own_request_s_min_p() -> None:
    params = [Params(temperature=1.0, min_p=0.3), Params(temperature=1.0), Params(temperature=0.0, min_p=0.5)]
    logits = logits_for(3, torch.float32)
    for greedy_rows in GreedyRows:
        got = row_distributions(logits, params, greedy_rows)
        torch.testing.assert_close(got[0], sorted_reference(logits[0], 1.0, 0, 1.0, 0.3), rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(got[1], logits[1].softmax(-1), rtol=1e-5, atol=1e-7)
