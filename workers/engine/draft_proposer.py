"""Draft-model proposer: a chain of k tokens, or a token tree, per sequence, in batched draft forwards.

The draft keeps its own paged KV (same block ids as the target, see BlockManager) with a valid prefix of
`spec.draft_num_computed` tokens. Each proposal first catches the draft up on the committed tokens it has
not seen (the previous step's accepted and bonus tokens, or the whole prompt the first time), then runs
one forward per further draft position. The proposer only reads its sequences: each Proposal says how far
the draft cache is valid afterwards (draft_num_computed), and the engine records it.
"""

import math
from collections.abc import Callable

import torch

from workers.engine.grammar import DraftGrammar
from workers.engine.model_runner import ForwardItem, ModelRunner
from workers.engine.sequence import Sequence
from workers.engine.target_logits import ProposerRules
from workers.spec.distributions import GreedyRows, row_distributions
from workers.spec.proposal import Proposal
from workers.spec.row_max import RowMax, torch_row_max
from workers.spec.tree import ROOT, TreeBuilder


class DraftFailure(RuntimeError):
    """The draft produced unusable output (non-finite logits); its sequences fall back to plain decoding."""


def draft_distributions(
    logits: torch.Tensor,  # [n, V] draft logits
    seqs: list[Sequence],  # [n] the sequence of each row
    greedy_rows: GreedyRows,  # ONE_HOT for chains; SOFTMAX when the caller ranks candidates (greedy trees)
) -> torch.Tensor:  # [n, V] float32
    """q per row: the request's sampling transform, the same as the target's (see row_distributions)."""
    check_logits(logits)
    return row_distributions(logits, [s.params for s in seqs], greedy_rows)


def check_logits(logits: torch.Tensor) -> None:  # [n, V]
    """Raise DraftFailure for unusable proposer output: NaN or +inf anywhere, or a row with no finite logit.
    -inf alone is a token the proposer never drafts (an EAGLE head's draft vocabulary, workers/models/eagle_head.py)."""
    check_row_maxima(logits.amax(dim=-1).tolist())


def check_row_maxima(maxima: list[float]) -> None:  # [n] each row's largest logit
    """check_logits from the rows' maxima: a maximum carries NaN and +inf, and is -inf for an empty row."""
    if not all(math.isfinite(value) for value in maxima):
        raise DraftFailure("draft logits are not finite")


def append_draws(
    q: torch.Tensor,  # [A, V] proposal distributions, one row per active sequence
    rows: list[tuple[Sequence, list[int], list[torch.Tensor]]],  # [A] (sequence, its tokens, its q rows so far)
) -> None:
    """One more draft token per row: the argmax for greedy requests, else a draw with the request's generator
    (its q row is kept: verification needs it)."""
    for row, (seq, tokens, probs) in enumerate(rows):
        if seq.params.is_greedy:
            tokens.append(int(q[row].argmax()))
        else:
            tokens.append(int(torch.multinomial(q[row], 1, generator=seq.generator)))
            probs.append(q[row])


def draw_chain_step(
    logits: torch.Tensor,  # [A, V] the proposer's logits at depth j, one row per active sequence
    active: list[int],  # [A] indices into seqs of the sequences still drafting
    seqs: list[Sequence],  # [B]
    tokens: list[list[int]],  # [B] each sequence's tokens so far (drafts appended here)
    probs: list[list[torch.Tensor]],  # [B] each sequence's q rows so far
    grammar: DraftGrammar,  # the sequences' grammar states during this proposal
    ks: list[int],  # [B] each sequence's chain length; cut where its grammar completes
    depth: int,  # j: the draft position this step fills
    row_max: RowMax = torch_row_max,  # each row's max and argmax (the engine's is native where it can be)
    rules: ProposerRules = ProposerRules(),  # the requests' logit_bias, penalties, min_tokens (target_logits.py)
) -> None:
    """Depth j of the draft model's and the EAGLE head's chains alike: draw a token per active sequence (under
    its grammar), advance the grammar, and end a chain whose grammar completes, or whose grammar takes no token
    the proposer drafts (a head's draft vocabulary can lack them all): that chain ends before depth j. Each row
    takes its request's logit_bias, penalties and min_tokens first, as the target's will (ProposerRules)."""
    logits = rules.apply(logits, [seqs[i] for i in active], [tokens[i] for i in active])
    allowed = grammar.allowed(active) if grammar.is_active else None  # [A, V] | None
    if allowed is None and all(seqs[i].params.is_greedy for i in active):  # the argmax is the draft: no q rows
        best, argmax = row_max(logits)  # [A] each: the check and the draws in one pass over the rows
        check_row_maxima(best)
        for i, token in zip(active, argmax, strict=True):
            tokens[i].append(token)
    else:
        check_logits(logits)
        if allowed is not None:  # only the tokens each row's grammar takes (workers/engine/grammar.py)
            logits = logits.masked_fill(~allowed, float("-inf"))  # [A, V]
            draftable = (logits.amax(dim=-1) > float("-inf")).tolist()  # [A]
            if not all(draftable):
                for i, ok in zip(active, draftable, strict=True):
                    if not ok:
                        ks[i] = depth
                rows = [row for row, ok in enumerate(draftable) if ok]
                logits, active = logits[rows], [active[row] for row in rows]
                if not active:
                    return
        q = row_distributions(logits, [seqs[i].params for i in active], GreedyRows.ONE_HOT)  # [A, V]
        append_draws(q, [(seqs[i], tokens[i], probs[i]) for i in active])
    for i in active:
        if not grammar.advance(i, tokens[i][-1]):
            ks[i] = depth + 1  # the grammar is complete: nothing to draft past it


def grow_trees(
    logits: torch.Tensor,  # [B, V] the proposer's logits after each sequence's last committed token
    seqs: list[Sequence],  # [B]
    sizes: list[int],  # [B] nodes per tree at most
    branching: int,
    forward_frontiers: Callable[[list[int], list[TreeBuilder]], torch.Tensor],  # (active, builders) -> [F, V]
) -> list[TreeBuilder]:
    """Token trees for the draft model and the EAGLE head alike, grown level by level by the proposer's own
    probabilities (TreeBuilder: the best cumulative path probabilities win the node budget, EAGLE-2): each
    level is one forward over the frontier nodes of every tree still growing, in `active` order (F rows)."""
    builders = [
        TreeBuilder(size, branching, seq.params.is_greedy, seq.generator) for seq, size in zip(seqs, sizes, strict=True)
    ]
    rules = ProposerRules()  # a tree's sequence: its logit_bias alone applies (ProposerRules)
    q = draft_distributions(rules.apply(logits, seqs, [[] for _ in seqs]), seqs, GreedyRows.SOFTMAX)  # [B, V]
    for b, builder in enumerate(builders):
        builder.expand(q[b : b + 1])
    while True:
        active = [b for b, builder in enumerate(builders) if not builder.is_done]
        if not active:
            return builders
        logits = forward_frontiers(active, builders)  # [F, V]
        owners = [seqs[b] for b in active for _ in builders[b].frontier]
        logits = rules.apply(logits, owners, [[] for _ in owners])  # [F, V]
        q = draft_distributions(logits, owners, GreedyRows.SOFTMAX)  # [F, V]
        row = 0
        for b in active:
            width = len(builders[b].frontier)
            builders[b].expand(q[row : row + width])
            row += width


class DraftProposer:
    def __init__(
        self, runner: ModelRunner, row_max: RowMax = torch_row_max, eos_token_ids: frozenset[int] = frozenset()
    ) -> None:
        # the requests' rules on its rows: its own logits' scale is not the target's (ProposerRules)
        self.rules = ProposerRules(eos_token_ids, takes_repetition=False)
        self.runner = runner
        self.row_max = row_max  # the greedy drafts: each logits row's max and argmax

    def _catch_up(self, seqs: list[Sequence]) -> torch.Tensor:  # [B, V] draft logits after each last token
        """Feed each sequence's committed tokens the draft has not seen; its cache then holds len(seq)."""
        items = []
        for seq in seqs:
            assert seq.spec is not None
            start = min(seq.spec.draft_num_computed, len(seq) - 1)
            items.append(ForwardItem(seq.token_ids[start:], start, seq.block_table, num_logits=1))
        return self.runner.forward(items)

    @staticmethod
    def can_prefill(seq: Sequence) -> bool:
        """The target has computed tokens the draft has not."""
        assert seq.spec is not None
        return seq.num_computed_tokens > seq.spec.draft_num_computed

    def prefill(self, seqs: list[Sequence]) -> list[Proposal]:
        """Feed the draft the tokens the target has computed and it has not (a prefill chunk's), no logits,
        so a sequence's first proposal catches up on one token instead of its whole prompt. Proposals with no
        tokens: only their draft cache length."""
        items, ends = [], []
        for seq in seqs:
            assert seq.spec is not None
            start, end = seq.spec.draft_num_computed, seq.num_computed_tokens
            items.append(ForwardItem(seq.token_ids[start:end], start, seq.block_table, num_logits=0))
            ends.append(end)
        self.runner.forward(items)
        return [Proposal([], None, draft_num_computed=end) for end in ends]

    def propose_chains(self, seqs: list[Sequence], ks: list[int]) -> list[Proposal]:
        """k_i draft tokens per sequence (fewer where a grammar completes); the draft cache ends valid for
        len + k_i - 1 tokens."""
        tokens: list[list[int]] = [[] for _ in seqs]
        probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        grammar = DraftGrammar([seq.grammar for seq in seqs])
        ks = list(ks)
        logits = self._catch_up(seqs)  # [B, V]
        active = list(range(len(seqs)))
        try:
            for j in range(max(ks)):
                if not active:
                    break
                if j > 0:
                    items = [
                        ForwardItem([tokens[i][-1]], len(seqs[i]) + j - 1, seqs[i].block_table, num_logits=1)
                        for i in active
                    ]
                    logits = self.runner.forward(items)  # [A, V]
                draw_chain_step(logits, active, seqs, tokens, probs, grammar, ks, j, self.row_max, self.rules)
                active = [i for i in active if ks[i] > j + 1]
        finally:
            grammar.rollback()
        return [
            Proposal(t, torch.stack(p) if p else None, draft_num_computed=len(seq) + k - 1)
            for seq, k, t, p in zip(seqs, ks, tokens, probs, strict=True)
        ]

    def propose_trees(self, seqs: list[Sequence], sizes: list[int], branching: int) -> list[Proposal]:
        """A token tree of up to sizes[i] nodes per sequence, grown level by level (grow_trees)."""

        def forward_frontiers(active: list[int], builders: list[TreeBuilder]) -> torch.Tensor:  # [F, V]
            return self.runner.forward([self._frontier_item(seqs[b], builders[b]) for b in active])

        builders = grow_trees(self._catch_up(seqs), seqs, sizes, branching, forward_frontiers)
        proposals = []
        for seq, builder in zip(seqs, builders, strict=True):
            tree, tree_probs = builder.build()
            # tree slots are scratch: the draft cache stays valid for the committed tokens, accepted ones are re-fed
            proposals.append(Proposal(tree.tokens.tolist(), tree_probs, tree, draft_num_computed=len(seq)))
        return proposals

    @staticmethod
    def _frontier_item(seq: Sequence, builder: TreeBuilder) -> ForwardItem:
        """The frontier nodes as queries in their tree slots, seeing the prefix and their ancestors."""
        frontier = builder.frontier
        assert frontier and frontier[0] != ROOT and frontier == list(range(frontier[0], frontier[-1] + 1))
        tree, _ = builder.build()
        length = len(seq)
        return ForwardItem(
            token_ids=[builder.token(node) for node in frontier],
            start_pos=length + frontier[0],
            block_table=seq.block_table,
            num_logits=len(frontier),
            positions=tree.positions(length)[frontier].tolist(),
            tree_start=length,
            tree_mask=tree.attention_mask()[frontier],  # [f, n]
        )
