"""Log-probabilities of the target model, read from the logits a step already computes (no extra pass).

Output tokens: every token a step appends, whether the target sampled it plainly or accepted it from a draft,
was scored by one row of the target's verification logits: token i of a verdict by the row of its parent
(chains: row i; trees: row 0 for the first token, else 1 + the previous accepted node). Its logprob is that
row's log-softmax of the raw logits (before temperature, top-k or top-p: vLLM's default `raw_logprobs`), the same
value whether speculation was on or off, so the figure never depends on the method.

Prompt tokens (`prompt_logprobs`, OpenAI's `echo`): a prefill chunk of such a request asks the runner for the
logits of every one of its rows (`widen`), not just the last; the engine verifies on the usual rows
(`verify_rows`) and records each prompt token's logprob from the row before it. A request that does not ask
costs nothing: its items and the logits tensor are unchanged.
"""

from dataclasses import replace
from functools import cached_property

import torch

from workers.engine.model_runner import ForwardItem
from workers.engine.outputs import TokenLogprob
from workers.engine.scheduler_output import ScheduledSeq
from workers.spec.proposal import Proposal, Verdict

MAX_LOGPROBS = 20  # top alternatives per token, as OpenAI's top_logprobs


def wants_prompt_rows(s: ScheduledSeq) -> bool:
    """The chunk holds prompt tokens whose logprobs the request wants and has not recorded yet."""
    seq = s.seq
    if seq.params.prompt_logprobs is None or s.start_pos >= seq.num_prompt_tokens:
        return False
    return len(seq.prompt_logprobs) < seq.num_prompt_tokens - 1


def widen(s: ScheduledSeq, item: ForwardItem) -> ForwardItem:
    """The item, asking for every row's logits when its prompt logprobs are wanted (a prefill chunk: the rows
    the engine verifies stay the last ones)."""
    if not wants_prompt_rows(s) or item.num_logits > 1:
        return item
    return replace(item, num_logits=len(item.token_ids))


def verify_rows(items: list[ForwardItem], num_verify: list[int]) -> torch.Tensor | None:
    """[rows] indices of the logits rows verification reads (each item's last num_verify rows), or None when
    that is every row (no item was widened)."""
    if all(it.num_logits == n for it, n in zip(items, num_verify, strict=True)):
        return None
    rows: list[int] = []
    offset = 0
    for it, n in zip(items, num_verify, strict=True):
        rows.extend(range(offset + it.num_logits - n, offset + it.num_logits))
        offset += it.num_logits
    return torch.tensor(rows, dtype=torch.long)


def token_logprobs(logits: torch.Tensor, token_ids: list[int], num_top: int) -> list[TokenLogprob]:
    """logits: [n, V] raw, the row that scored each of token_ids -> each token's logprob and top alternatives."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [n, V]
    ids = torch.tensor(token_ids, dtype=torch.long)  # [n]
    chosen = logprobs.gather(1, ids[:, None])[:, 0].tolist()  # [n]
    if num_top:
        top_values, top_ids = logprobs.topk(min(num_top, logprobs.shape[-1]), dim=-1)  # [n, num_top] each
        tops = [tuple(zip(i, v, strict=True)) for i, v in zip(top_ids.tolist(), top_values.tolist(), strict=True)]
    else:
        tops = [() for _ in token_ids]
    return [TokenLogprob(t, lp, top) for t, lp, top in zip(token_ids, chosen, tops, strict=True)]


class StepLogits:
    """One step's logits rows, by plan entry: where each item's rows start."""

    def __init__(self, logits: torch.Tensor, items: list[ForwardItem]) -> None:
        self.logits = logits  # [S, V] raw target logits, every item's num_logits rows back to back
        self.items = items

    @cached_property
    def starts(self) -> list[int]:
        """[num_items] the first row of each item (counted only in a step where a request wants logprobs)."""
        starts, row = [], 0
        for it in self.items:
            starts.append(row)
            row += it.num_logits
        return starts

    def record_prompt(self, index: int, s: ScheduledSeq) -> None:
        """Keep the prompt tokens' logprobs this chunk scored (each token from the row before it)."""
        seq, item = s.seq, self.items[index]
        if seq.params.prompt_logprobs is None or item.num_logits < len(item.token_ids):
            return
        first = len(seq.prompt_logprobs) + 1  # the next prompt position without a logprob (position 0 has none)
        # row i scores position start_pos + i + 1: the chunk's last row scores the next chunk's first token
        last = min(s.start_pos + len(item.token_ids), seq.num_prompt_tokens - 1)
        if last < first:
            return
        start_row = self.starts[index] + (first - 1 - s.start_pos)
        rows = self.logits[start_row : start_row + last - first + 1]  # [positions, V]
        seq.prompt_logprobs.extend(token_logprobs(rows, seq.token_ids[first : last + 1], seq.params.prompt_logprobs))

    def of_tokens(
        self, index: int, proposal: Proposal | None, verdict: Verdict, tokens: list[int], num_top: int
    ) -> list[TokenLogprob]:
        """The logprobs of `tokens` (the verdict's, up to a stop) from the rows that scored them."""
        if not tokens:
            return []
        num_verify = 1 + (proposal.num_tokens if proposal is not None else 0)
        first_row = self.starts[index] + self.items[index].num_logits - num_verify
        if proposal is not None and proposal.tree is not None:
            parents = [0, *(1 + node for node in (verdict.accepted_nodes or []))]
        else:
            parents = list(range(len(tokens)))
        rows = torch.tensor([first_row + p for p in parents[: len(tokens)]], dtype=torch.long)
        return token_logprobs(self.logits.index_select(0, rows), tokens, num_top)
