"""draw_chain_step: the greedy rows' drafts are their argmaxes, and unusable proposer rows fail the proposal, on the
greedy path (one max pass) as on the sampling path (check_logits)."""

import pytest
import torch

from workers.engine.detokenizer import Detokenizer
from workers.engine.draft_proposer import DraftFailure, draw_chain_step
from workers.engine.grammar import DraftGrammar
from workers.engine.sampling_params import SamplingParams
from workers.engine.sequence import Sequence

VOCAB = 8
NEG_INF = float("-inf")


def _seq(request_id: str, temperature: float) -> Sequence:
    params = SamplingParams(max_tokens=8, temperature=temperature)
    generator = None if params.is_greedy else torch.Generator().manual_seed(0)
    return Sequence(request_id, [1, 2, 3], 3, params, Detokenizer(lambda ids: "", [1, 2, 3], []), generator)


def _draw(logits: torch.Tensor, temperatures: list[float]) -> list[list[int]]:  # logits [B, VOCAB]
    seqs = [_seq(str(i), t) for i, t in enumerate(temperatures)]
    tokens: list[list[int]] = [[] for _ in seqs]
    probs: list[list[torch.Tensor]] = [[] for _ in seqs]
    ks = [4] * len(seqs)
    draw_chain_step(logits, list(range(len(seqs))), seqs, tokens, probs, DraftGrammar([None] * len(seqs)), ks, 0)
    return tokens


def test_greedy_rows_draft_their_argmax() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0, 0, 0, 0, 0, 0], [NEG_INF] * 7 + [-5.0]])  # [2, 8]: a draft vocabulary's row

    assert _draw(logits, [0.0, 0.0]) == [[1], [7]]


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), "empty"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_an_unusable_row_fails_the_proposal(bad: float | str, temperature: float) -> None:
    logits = torch.zeros(2, VOCAB)
    if bad == "empty":
        logits[1] = NEG_INF  # a row that drafts nothing
    else:
        logits[1, 3] = bad

    with pytest.raises(DraftFailure, match="not finite"):
        _draw(logits, [0.0, temperature])
