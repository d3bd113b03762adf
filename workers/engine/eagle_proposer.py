"""EAGLE-head proposer: a chain of k tokens, or a token tree grown by the head's confidence (EAGLE-2).

Head row t reads the target's feature f_t and token t + 1 (workers/models/eagle_head.py). A sequence of
length L has committed features for positions 0 .. L - 2 (the last token, just sampled, has none yet: the
target computes it in this step's pass), kept on its SpecState by the engine. Each proposal first catches
the head up on rows draft_num_computed .. L - 2 (true features); the last of them gives the first draft
token's q and the head's own feature guess for position L - 1. Further positions feed those guesses back.
Speculative rows are scratch: the head cache stays valid for the L - 1 caught-up rows (draft_num_computed),
and next step recomputes from there with the target's features of whatever was accepted.
"""

import torch

from workers.engine.draft_proposer import DraftFailure, draw_chain_step, grow_trees
from workers.engine.grammar import DraftGrammar
from workers.engine.head_runner import HeadRunner
from workers.engine.model_runner import ForwardItem
from workers.engine.sequence import Sequence
from workers.engine.target_logits import ProposerRules
from workers.spec.proposal import Proposal
from workers.spec.row_max import RowMax, torch_row_max
from workers.spec.tree import ROOT, TreeBuilder


class EagleProposer:
    def __init__(
        self, runner: HeadRunner, row_max: RowMax = torch_row_max, eos_token_ids: frozenset[int] = frozenset()
    ) -> None:
        self.rules = ProposerRules(eos_token_ids)  # the requests' rules on its rows (the target's LM head's scale)
        self.runner = runner
        self.row_max = row_max  # the greedy drafts: each logits row's max and argmax

    def _catch_up(self, seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor]:  # [B, V] logits, [B, hidden]
        """Head rows draft_num_computed .. L - 2 of each sequence; its cache then holds L - 1 rows."""
        items: list[ForwardItem] = []
        features: list[torch.Tensor] = []
        for seq in seqs:
            spec = seq.spec
            assert spec is not None
            last_row = len(seq) - 2  # the last position with a committed feature
            start = min(spec.draft_num_computed, last_row)
            if spec.features is None or not spec.features_start <= start or spec.features_end < last_row + 1:
                raise DraftFailure(
                    f"{seq.request_id}: features kept for [{spec.features_start}, {spec.features_end}), "
                    f"the head needs [{start}, {last_row + 1})"
                )
            features.append(spec.features[start - spec.features_start : last_row + 1 - spec.features_start])
            items.append(ForwardItem(seq.token_ids[start + 1 :], start, seq.block_table, num_logits=1))
        return self.runner.forward(items, torch.cat(features))

    @staticmethod
    def can_prefill(seq: Sequence) -> bool:
        """There are kept features from the head's next row on, and a row before the one the next proposal
        starts from."""
        spec = seq.spec
        assert spec is not None
        return spec.has_features and spec.features_start <= spec.draft_num_computed < prefill_end(seq)

    def prefill(self, seqs: list[Sequence]) -> list[Proposal]:
        """Head rows draft_num_computed .. before the last committed row, those whose features the target's pass
        just kept (a prefill chunk's), no logits, so a sequence's first proposal catches up on a row or two
        instead of its whole prompt. The last committed row (L - 2) is left to the proposal, whose catch-up
        starts there to get its first draft token's logits. Proposals with no tokens: the head cache's length."""
        items: list[ForwardItem] = []
        features: list[torch.Tensor] = []
        ends = []
        for seq in seqs:
            spec = seq.spec
            assert spec is not None and spec.features is not None
            start = spec.draft_num_computed  # kept features begin at or before it (can_prefill)
            end = prefill_end(seq)  # rows start .. end - 1
            features.append(spec.features[start - spec.features_start : end - spec.features_start])
            items.append(ForwardItem(seq.token_ids[start + 1 : end + 1], start, seq.block_table, num_logits=0))
            ends.append(end)
        self.runner.forward(items, torch.cat(features))
        return [Proposal([], None, draft_num_computed=end) for end in ends]

    def propose_chains(self, seqs: list[Sequence], ks: list[int]) -> list[Proposal]:
        """k_i draft tokens per sequence, one head pass per position."""
        tokens: list[list[int]] = [[] for _ in seqs]
        probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        grammar = DraftGrammar([seq.grammar for seq in seqs])
        ks = list(ks)
        logits, hidden = self._catch_up(seqs)  # [B, V], [B, hidden]
        active = list(range(len(seqs)))
        try:
            for j in range(max(ks)):
                if not active:
                    break
                if j > 0:  # row L - 2 + j: the head's own feature for position L - 2 + j, the token drafted last
                    items = [
                        ForwardItem([tokens[i][-1]], len(seqs[i]) - 2 + j, seqs[i].block_table, num_logits=1)
                        for i in active
                    ]
                    logits, hidden = self.runner.forward(items, hidden)  # [A, V], [A, hidden]
                draw_chain_step(logits, active, seqs, tokens, probs, grammar, ks, j, self.row_max, self.rules)
                keep = [row for row, i in enumerate(active) if ks[i] > j + 1]
                if len(keep) < len(active):  # a chain ended: its row leaves the next pass
                    hidden = hidden[keep]  # [A', hidden]
                    active = [active[row] for row in keep]
        finally:
            grammar.rollback()
        return [
            Proposal(t, torch.stack(p) if p else None, draft_num_computed=len(seq) - 1)
            for seq, t, p in zip(seqs, tokens, probs, strict=True)
        ]

    def propose_trees(self, seqs: list[Sequence], sizes: list[int], branching: int) -> list[Proposal]:
        """A token tree of up to sizes[i] nodes per sequence, grown level by level by the head's own
        probabilities (grow_trees); a node's row reads its parent's hidden state as its feature."""
        logits, hidden = self._catch_up(seqs)  # [B, V], [B, hidden]
        node_hidden: list[dict[int, torch.Tensor]] = [{ROOT: hidden[b]} for b in range(len(seqs))]  # node -> [hidden]

        def forward_frontiers(active: list[int], builders: list[TreeBuilder]) -> torch.Tensor:  # [F, V]
            items = [self._frontier_item(seqs[b], builders[b]) for b in active]
            features = torch.stack(
                [node_hidden[b][builders[b].parent(node)] for b in active for node in builders[b].frontier]
            )  # [F, hidden]
            logits, hidden = self.runner.forward(items, features)  # [F, V], [F, hidden]
            row = 0
            for b in active:
                for offset, node in enumerate(builders[b].frontier):
                    node_hidden[b][node] = hidden[row + offset]
                row += len(builders[b].frontier)
            return logits

        builders = grow_trees(logits, seqs, sizes, branching, forward_frontiers)
        proposals = []
        for seq, builder in zip(seqs, builders, strict=True):
            tree, tree_probs = builder.build()
            proposals.append(Proposal(tree.tokens.tolist(), tree_probs, tree, draft_num_computed=len(seq) - 1))
        return proposals

    @staticmethod
    def _frontier_item(seq: Sequence, builder: TreeBuilder) -> ForwardItem:
        """The frontier nodes as head rows: node n (depth d) reads its parent's h and its own token, sits at
        rotary position L - 1 + d in scratch slot L - 1 + n, and sees the committed rows and its ancestors."""
        frontier = builder.frontier
        assert frontier and frontier[0] != ROOT and frontier == list(range(frontier[0], frontier[-1] + 1))
        tree, _ = builder.build()
        first_row = len(seq) - 1  # the root's children are rows at position L - 1
        return ForwardItem(
            token_ids=[builder.token(node) for node in frontier],
            start_pos=first_row + frontier[0],
            block_table=seq.block_table,
            num_logits=len(frontier),
            positions=tree.positions(first_row)[frontier].tolist(),
            tree_start=first_row,
            tree_mask=tree.attention_mask()[frontier],  # [f, n]
        )


def prefill_end(seq: Sequence) -> int:
    """One past the last head row EagleProposer.prefill computes: row t reads feature t (kept up to
    features_end) and token t + 1, and the last committed row, L - 2, stays for the next proposal."""
    assert seq.spec is not None
    return min(len(seq) - 2, seq.spec.features_end)
