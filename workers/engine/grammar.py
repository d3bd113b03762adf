"""Structured output inside the engine: one llguidance matcher per constrained sequence (SamplingParams.grammar,
compiled by shared/response_format.py) and the masks it puts on target and draft distributions.

Exactness under speculation. The matcher holds the sequence's committed output. At every verified position
the target's logits are masked by the grammar state after the draft tokens before it (`mask_target_logits`:
advance over the draft, take each state's mask, roll back), so verification samples from the same masked
distribution constrained plain decoding samples from: greedy output is token-identical, sampled output has
the same distribution (rejection sampling is lossless for any q, and a masked p gives a token the grammar
refuses probability 0). Drafts are proposed under the same grammar (`DraftGrammar`: the draft model's and the
EAGLE head's chains mask their logits state by state and roll back afterwards; n-gram proposals are cut at
their first token the grammar refuses, `valid_prefix`), so no draft position is spent on a token that could
never be accepted. A constrained sequence drafts chains only, never trees (the speculator checks
`is_constrained`). The applier advances the matcher by each committed token (workers/engine/apply.py); a
sequence whose grammar is complete stops there (`stop`).
"""

from typing import Any

import llguidance
import llguidance.hf
import llguidance.torch
import torch

from workers.engine.errors import InvalidRequestError

BIT_INDEX = torch.arange(32, dtype=torch.int32)  # [32]


class GrammarCompiler:
    """The engine's tokenizer as llguidance sees it (the byte string of every token id), built once."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: frozenset[int]) -> None:
        self.vocab_size = vocab_size  # the model's logits width (may exceed the tokenizer's vocabulary)
        eos = sorted(eos_token_ids) or None
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos)

    def matcher(self, grammar: str) -> "GrammarMatcher":
        """A fresh matcher for one request; InvalidRequestError when the grammar does not compile."""
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise InvalidRequestError("response_format", matcher.get_error())
        return GrammarMatcher(matcher, self.vocab_size)


class GrammarMatcher:
    """One sequence's grammar state: it has consumed exactly the sequence's committed output tokens."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size
        self._bitmask = llguidance.torch.allocate_token_bitmask(1, vocab_size)  # [1, ceil(V / 32)] int32

    def allowed(self) -> torch.Tensor:  # [V] bool: the tokens the grammar takes next
        """The mask of the current state; a stopped grammar allows only EOS (never an empty row)."""
        llguidance.torch.fill_next_token_bitmask(self.matcher, self._bitmask, 0)
        bits = (self._bitmask[0].unsqueeze(1) >> BIT_INDEX) & 1  # [W, 32]
        return bits.flatten()[: self.vocab_size].bool()

    def advance(self, token: int) -> bool:
        """Consume one committed token; True when the grammar is now complete (nothing may follow)."""
        if not self.matcher.consume_token(token):
            raise RuntimeError(f"the grammar refused token {token}: {self.matcher.get_error()}")
        return self.matcher.is_stopped()

    def try_advance(self, token: int) -> bool:
        """Consume a drafted token (rolled back later); False when the grammar refuses it or is complete."""
        if self.matcher.is_stopped() or self.matcher.try_consume_tokens([token]) != 1:
            return False
        return True

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self.matcher.rollback(num_tokens)

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of `tokens` the grammar takes in a row from here (it stays where it is)."""
        return int(self.matcher.validate_tokens(tokens)) if tokens else 0

    def row_masks(self, tokens: list[int]) -> torch.Tensor:  # [len(tokens) + 1, V] bool
        """The mask before each draft token and after the last: the grammar states verification scores."""
        masks = [self.allowed()]
        consumed = 0
        for token in tokens:
            if not self.try_advance(token):  # never accepted (p = 0): any mask is fine for what follows
                break
            consumed += 1
            masks.append(self.allowed())
        self.rollback(consumed)
        masks.extend(masks[-1:] * (len(tokens) + 1 - len(masks)))
        return torch.stack(masks)


def mask_target_logits(
    logits: torch.Tensor,  # [S, V] the target's logits: each entry's 1 + len(drafts) rows, entries in order
    entries: list[tuple[GrammarMatcher | None, list[int]]],  # [B] (matcher or None, its draft tokens this step)
) -> None:
    """Refused tokens' logits become -inf, in place, at every row a constrained sequence verifies."""
    row = 0
    with torch.inference_mode():  # the runner's logits are inference tensors
        for matcher, drafts in entries:
            if matcher is not None:
                allowed = matcher.row_masks(drafts)  # [k + 1, V]
                logits[row : row + len(drafts) + 1].masked_fill_(~allowed, float("-inf"))
            row += len(drafts) + 1


class DraftGrammar:
    """The grammar states of one chain proposal: each constrained row is masked by the state after the
    tokens drafted so far; `rollback` returns every matcher to its committed state."""

    def __init__(self, matchers: list[GrammarMatcher | None]) -> None:  # [B] one per proposing sequence
        self.matchers = matchers
        self.num_drafted = [0] * len(matchers)  # [B] tokens each matcher consumed for this proposal

    @property
    def is_active(self) -> bool:
        return any(m is not None for m in self.matchers)

    def allowed(self, rows: list[int]) -> torch.Tensor | None:  # [len(rows), V] bool, or None = unconstrained
        """The masks of the sequences `rows` (their indices) in their current drafting states."""
        if not any(self.matchers[i] is not None for i in rows):
            return None
        masks = []
        for i in rows:
            matcher = self.matchers[i]
            masks.append(matcher.allowed() if matcher is not None else None)
        vocab = next(m for m in masks if m is not None).shape[0]
        return torch.stack([m if m is not None else torch.ones(vocab, dtype=torch.bool) for m in masks])

    def advance(self, i: int, token: int) -> bool:
        """Sequence i drafted `token` (from its masked row); False when its chain must end after it (the grammar
        is complete)."""
        matcher = self.matchers[i]
        if matcher is None:
            return True
        if not matcher.try_advance(token):
            raise RuntimeError(f"a draft drew token {token}, which its grammar refuses")
        self.num_drafted[i] += 1
        return not matcher.matcher.is_stopped()

    def rollback(self) -> None:
        for matcher, num in zip(self.matchers, self.num_drafted, strict=True):
            if matcher is not None:
                matcher.rollback(num)
        self.num_drafted = [0] * len(self.matchers)
