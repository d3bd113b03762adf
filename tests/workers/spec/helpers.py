"""Shared test helpers: a chi-square goodness-of-fit p-value and a toy Markov language model."""

from dataclasses import dataclass

import torch

from workers.spec.distributions import logits_to_probs


def chi_square_p_value(counts: torch.Tensor, expected_probs: torch.Tensor) -> float:  # [C] each
    """P-value of Pearson's chi-square test that `counts` were drawn from `expected_probs`.

    Cells the model gives probability 0 must be empty (asserted) and leave the test's degrees of freedom.
    Survival function of chi2(df) at x is the regularised upper incomplete gamma Q(df / 2, x / 2).
    """
    counts, expected_probs = counts.double().flatten(), expected_probs.double().flatten()
    is_possible = expected_probs > 0  # [C]
    assert counts[~is_possible].sum() == 0, f"impossible cells drawn: {counts[~is_possible]}"
    expected = expected_probs[is_possible] * counts.sum()  # [C']
    statistic = ((counts[is_possible] - expected) ** 2 / expected).sum()
    num_dof = int(is_possible.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(num_dof / 2.0, dtype=torch.double), statistic / 2.0))


@dataclass
class MarkovModel:
    """Next-token distributions that depend on the previous token: rows[t] = distribution after token t."""

    rows: torch.Tensor  # [V, V]

    @property
    def vocab(self) -> int:
        return int(self.rows.shape[0])

    def pair_probs(self, start: int) -> torch.Tensor:  # [V, V]: P(x1, x2) after `start`
        return self.rows[start].unsqueeze(1) * self.rows


def make_pair(
    vocab: int,
    seed: int,
    temperature: float = 1.0,
    top_k: int = -1,
    top_p: float = 1.0,
    min_p: float = 0.0,
) -> tuple[MarkovModel, MarkovModel]:
    """A (target, draft) pair with related but different distributions, both through logits_to_probs."""
    gen = torch.Generator().manual_seed(seed)
    target_logits = torch.randn(vocab, vocab, generator=gen) * 1.5  # [V, V]
    draft_logits = target_logits + torch.randn(vocab, vocab, generator=gen) * 1.2  # [V, V]

    def transform(logits: torch.Tensor) -> torch.Tensor:  # [V, V] -> [V, V]
        return logits_to_probs(
            logits,
            torch.full((vocab,), temperature),
            torch.full((vocab,), top_k, dtype=torch.long),
            torch.full((vocab,), top_p),
            torch.full((vocab,), min_p),
        )

    return MarkovModel(transform(target_logits)), MarkovModel(transform(draft_logits))
