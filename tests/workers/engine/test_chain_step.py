"""draw_chain_step: the greedy rows' drafts are their argmaxes, and unusable proposer rows fail the proposal, on the
greedy path (one max pass) as on the sampling path (check_logits)."""

import pytest
import torch

from workers.engine.detokenizer import Detokenizer
from workers.engine.draft_proposer import DraftFailure, draw_chain_step
from workers.engine.grammar import DraftGrammar
from workers.engine.sampling_params import SamplingParams
from workers.engine.sequence import Sequence
from workers.engine.target_logits import ProposerRules

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


def test_drafts_follow_the_requests_bias_penalties_and_min_tokens() -> None:
    """A proposer's rows take the same rules as the target's (target_logits.processed_proposer_rows): a banned
    token, a token its penalties now outweigh (counting the chain's own drafts) and a stop token min_tokens holds
    back are not drafted only to be refused; q is what the draft drew from, sampled rows included."""
    eos = 7
    cases = [  # (params, output so far, the proposer's favourite, a close second)
        (SamplingParams(max_tokens=8, temperature=0.0, logit_bias={4: -100.0}), [], 4, 2),
        (SamplingParams(max_tokens=8, temperature=0.0, frequency_penalty=2.0), [5, 5], 5, 2),
        (SamplingParams(max_tokens=8, temperature=0.0, min_tokens=4), [6], eos, 2),
        (SamplingParams(max_tokens=8, temperature=0.8, seed=1, logit_bias={4: -100.0}), [], 4, 2),
    ]
    for params, output, favourite, second in cases:
        generator = None if params.is_greedy else torch.Generator().manual_seed(0)
        prompt = [1, 2, 3]
        seq = Sequence("s", prompt + output, 3, params, Detokenizer(lambda ids: "", prompt, []), generator)
        logits = torch.full((1, VOCAB), -10.0)
        logits[0, favourite], logits[0, second] = 3.0, 2.5
        tokens: list[list[int]] = [[]]
        probs: list[list[torch.Tensor]] = [[]]
        draw_chain_step(logits, [0], [seq], tokens, probs, DraftGrammar([None]), [4], 0, rules=ProposerRules(frozenset({eos})))
        assert tokens[0] == [second], (params, tokens)
        if not params.is_greedy:
            assert float(probs[0][0][favourite]) < 1e-30  # q: the biased distribution it drew from
    # a chain's own drafts count: the second position of a frequency-penalized chain pays for the first
    params = SamplingParams(max_tokens=8, temperature=0.0, frequency_penalty=1.0)
    seq = Sequence("s", [1, 2, 3], 3, params, Detokenizer(lambda ids: "", [1, 2, 3], []), None)
    logits = torch.full((1, VOCAB), -10.0)
    logits[0, 5], logits[0, 2] = 3.0, 2.5
    tokens, probs = [[]], [[]]
    for depth in range(2):
        draw_chain_step(logits, [0], [seq], tokens, probs, DraftGrammar([None]), [4], depth)
    assert tokens[0] == [5, 2]


def test_a_proposer_off_the_targets_scale_skips_the_repetition_penalty() -> None:
    """The repetition penalty scales logits: a draft model's (takes_repetition=False) are left as they are."""
    params = SamplingParams(max_tokens=8, temperature=0.0, repetition_penalty=2.0)
    seq = Sequence("s", [1, 2, 3], 3, params, Detokenizer(lambda ids: "", [1, 2, 3], []), None)
    logits = torch.tensor([[0.0, 3.0, 2.0, 0, 0, 0, 0, 0]])  # [1, 8]: token 1 is in the prompt
    assert torch.equal(ProposerRules(takes_repetition=False).apply(logits, [seq], [[]]), logits)
    assert ProposerRules().apply(logits, [seq], [[]])[0, 1] == 1.5  # the head on the target's scale takes it
