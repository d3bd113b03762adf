"""The values speculation hands back: a proposer's Proposal and verification's Verdict, for one sequence.

Neither is applied by the code that makes it: the engine applies both to its sequences (workers/engine/apply.py).
"""

from dataclasses import dataclass

import torch

from workers.spec.tree import ROOT, TokenTree


@dataclass
class Proposal:
    tokens: list[int]  # chain: [k] draft tokens in order; tree: [n] node tokens in node order
    draft_probs: torch.Tensor | None  # chain: [k, V] q each token was drawn from; tree: [n + 1, V]; None = fixed
    tree: TokenTree | None = None  # set for tree proposals
    # draft model only: tokens whose K/V the draft cache holds after proposing (the engine records it in
    # SpecState.draft_num_computed, then trims it to what verification keeps); None = no draft cache (n-gram)
    draft_num_computed: int | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def depth(self) -> int:
        """Draft positions along the longest path (chain: k)."""
        return len(self.tokens) if self.tree is None else int(self.tree.depth.max()) + 1 if self.tokens else 0


@dataclass
class Verdict:
    """Verification's outcome for one sequence this step."""

    tokens: list[int]  # accepted draft tokens + one recovered/bonus token
    num_accepted: int
    accepted_nodes: list[int] | None = None  # tree: the accepted root-to-node path

    def rejected_a_draft(self, proposal: Proposal) -> bool:
        """Did the target reject one of the proposal's draft tokens? A chain: fewer accepted than drafted. A tree:
        the accepted path ended at a node with children (one ending at a leaf was accepted whole, however
        deeper another branch went)."""
        if proposal.tree is None:
            return self.num_accepted < proposal.num_tokens
        return bool(proposal.tree.children(self.accepted_nodes[-1] if self.accepted_nodes else ROOT))
