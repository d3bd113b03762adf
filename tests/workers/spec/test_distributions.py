"""row_distributions: one (temperature, top-k, top-p) transform for target and draft, equal bit for bit to the
two builders it replaced (the target's in verify_batch, the draft's in draft_proposer), copied below."""

from dataclasses import dataclass

import pytest
import torch

from workers.spec.distributions import GreedyRows, logits_to_probs, row_distributions


@dataclass
class Params:
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0

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
