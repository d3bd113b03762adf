"""Token trees for tree speculation: the tree itself and the builder that grows it level by level.

Node numbering: nodes are indexed 0..n-1 in topological order (a parent always has a smaller index than its
children). The *root* is not a node: it is the last committed token, written as parent -1. Depth counts
speculative tokens above a node, so the root's children have depth 0 and sit at position `offset`, the
position right after the root (= the sequence's length including the root).

The target scores the tree in one pass with the input [root, node 0, ..., node n-1]: row 0 of its output is
the distribution over the root's children, row i+1 the distribution over node i's children. Draft
distributions recorded by the builder use the same layout, so `verify_tree` can index both by `node + 1`.
"""

import math
from dataclasses import dataclass, field

import torch

ROOT = -1  # parent index of the root's children: the root is the last committed token


@dataclass(eq=False)
class TokenTree:
    tokens: torch.Tensor  # [n] long, token of node i
    parents: torch.Tensor  # [n] long, parent node of node i; ROOT (-1) = the last committed token
    depth: torch.Tensor = field(init=False)  # [n] long, 0 for the root's children
    _children: list[list[int]] = field(init=False, repr=False)  # [n + 1]: entry node + 1 = node's children

    def __post_init__(self) -> None:
        if self.tokens.dim() != 1 or self.parents.shape != self.tokens.shape:
            raise ValueError(f"tokens and parents must be 1-D of equal length, got {self.tokens.shape}, {self.parents.shape}")
        parents = self.parents.tolist()
        self._children = [[] for _ in range(len(parents) + 1)]
        depth: list[int] = []
        for node, parent in enumerate(parents):
            if not ROOT <= parent < node:
                raise ValueError(f"node {node} has parent {parent}: parents must come first (ROOT = -1)")
            depth.append(0 if parent == ROOT else depth[parent] + 1)
            self._children[parent + 1].append(node)
        self.depth = torch.tensor(depth, dtype=torch.long, device=self.tokens.device)  # [n]

    @classmethod
    def chain(cls, tokens: torch.Tensor) -> "TokenTree":  # tokens: [k] long
        """A chain of k draft tokens: the tree with branching 1."""
        parents = torch.arange(tokens.shape[0], device=tokens.device) - 1  # [k]: node i's parent is i - 1
        return cls(tokens=tokens, parents=parents)

    @property
    def num_nodes(self) -> int:
        return int(self.tokens.shape[0])

    def children(self, node: int) -> list[int]:
        """Children of `node` (ROOT for the root's), in index order = the order verification tries them."""
        return self._children[node + 1]

    def path(self, node: int) -> list[int]:
        """Nodes from the root's child down to `node`, inclusive (empty for ROOT)."""
        nodes: list[int] = []
        parents = self.parents.tolist()
        while node != ROOT:
            nodes.append(node)
            node = parents[node]
        return nodes[::-1]

    def attention_mask(self) -> torch.Tensor:  # [n, n] bool
        """mask[i, j]: node i may attend to node j iff j is i or an ancestor of i.

        Every node also attends to the root and the committed prefix; the caller adds those columns.
        """
        n = self.num_nodes
        mask = torch.eye(n, dtype=torch.bool)  # [n, n]
        for node, parent in enumerate(self.parents.tolist()):
            if parent != ROOT:
                mask[node] |= mask[parent]  # parents come first, so their row is complete
        return mask.to(self.tokens.device)

    def positions(self, offset: int) -> torch.Tensor:  # [n] long
        """Sequence positions of the nodes; `offset` is the position of the root's children."""
        return offset + self.depth


class TreeBuilder:
    """Grows a TokenTree level by level from the draft's distributions, under a node budget.

    Use: while not builder.is_done: run the draft on `builder.frontier` (ROOT = the last committed token;
    `token(node)` gives the others' tokens, `build()` the partial tree's mask and positions), pass its
    distributions to `expand`. Then `build()`.

    Greedy mode (deterministic): every frontier node offers its top-`branching` tokens; candidates are kept
    in order of cumulative path probability under the draft until the budget is spent. Pass the draft's
    plain softmax here: one-hot rows (temperature 0 through logits_to_probs) offer a single token per node.
    build() returns draft_probs None: verify_tree treats the children as deterministic proposals, which is
    lossless for sampling requests too.

    Sampling mode: a frontier node's children are draws WITHOUT replacement from its q (Gumbel-top-k:
    sorting q / Exp(1) noise orders tokens like sequential draws without replacement). Frontier nodes are
    served in order of their path probability, `branching` children each, the last one served possibly
    fewer; how many children a node gets is decided before its children are drawn and they are always the
    first draws of its sequence - the property that keeps recursive rejection sampling lossless. Pass q
    after logits_to_probs with the request's settings (the same transform as the target's); it is recorded
    per expanded node for verify_tree.
    """

    def __init__(
        self,
        tree_size: int,  # maximum number of nodes (the root is not counted)
        branching: int,  # maximum children per node
        is_greedy: bool,  # deterministic top-`branching` (True) or draws without replacement (False)
        generator: torch.Generator | None = None,  # the sequence's generator (sampling mode)
        max_width: int | None = None,  # maximum new nodes per level; None = only the budget limits
    ) -> None:
        if tree_size < 1 or branching < 1 or (max_width is not None and max_width < 1):
            raise ValueError(f"need tree_size, branching, max_width >= 1, got {tree_size}, {branching}, {max_width}")
        self.tree_size = tree_size
        self.branching = branching
        self.is_greedy = is_greedy
        self.generator = generator
        self.max_width = max_width
        self.frontier: list[int] = [ROOT]  # nodes whose draft distribution `expand` needs next
        self._tokens: list[int] = []  # [n]
        self._parents: list[int] = []  # [n]
        self._path_logq: list[float] = []  # [n] log q of the path root -> node
        self._draft_rows: dict[int, torch.Tensor] = {}  # expanded node -> q over its children [V]
        self._device: torch.device | None = None  # the draft distributions' device, seen in expand

    @property
    def num_nodes(self) -> int:
        return len(self._tokens)

    def token(self, node: int) -> int:
        """Token of a node added so far (the engine feeds frontier tokens to the draft)."""
        return self._tokens[node]

    def parent(self, node: int) -> int:
        """Parent of a node added so far (ROOT for the root's children)."""
        return self._parents[node]

    @property
    def is_done(self) -> bool:
        return not self.frontier or self.num_nodes >= self.tree_size

    def expand(self, draft_probs: torch.Tensor) -> list[int]:  # draft_probs: [f, V], row j = q after frontier[j]
        """Add the next level's nodes; returns their indices, which become the new frontier."""
        if draft_probs.shape[0] != len(self.frontier):
            raise ValueError(f"expected {len(self.frontier)} rows (one per frontier node), got {draft_probs.shape[0]}")
        self._device = draft_probs.device
        num_new = self.tree_size - self.num_nodes
        if self.max_width is not None:
            num_new = min(num_new, self.max_width)
        if self.is_greedy:
            chosen = self._choose_top(draft_probs, num_new)
        else:
            chosen = self._choose_sampled(draft_probs, num_new)
        first = self.num_nodes
        for parent, token, logq in chosen:
            self._tokens.append(token)
            self._parents.append(parent)
            self._path_logq.append(logq)
        self.frontier = list(range(first, self.num_nodes))
        return self.frontier

    def _path_logq_of(self, node: int) -> float:
        return 0.0 if node == ROOT else self._path_logq[node]

    def _choose_top(self, draft_probs: torch.Tensor, num_new: int) -> list[tuple[int, int, float]]:
        num_top = min(self.branching, draft_probs.shape[1])
        top_probs, top_tokens = draft_probs.topk(num_top, dim=-1)  # [f, b] each, descending per row
        candidates: list[tuple[float, int, int, int]] = []  # (path log q, frontier rank, child rank, token)
        for j, (probs, tokens) in enumerate(zip(top_probs.tolist(), top_tokens.tolist(), strict=True)):
            base = self._path_logq_of(self.frontier[j])
            for rank, (prob, token) in enumerate(zip(probs, tokens, strict=True)):
                if prob > 0.0:
                    candidates.append((base + math.log(prob), j, rank, token))
        best = sorted(candidates, key=lambda c: -c[0])[:num_new]
        best.sort(key=lambda c: (c[1], c[2]))  # siblings stay in descending-q order
        return [(self.frontier[j], token, logq) for logq, j, _, token in best]

    def _choose_sampled(self, draft_probs: torch.Tensor, num_new: int) -> list[tuple[int, int, float]]:
        num_top = min(self.branching, draft_probs.shape[1])
        noise = torch.empty_like(draft_probs).exponential_(generator=self.generator).clamp_min_(1e-20)  # [f, V]
        draw_tokens = (draft_probs / noise).topk(num_top, dim=-1).indices  # [f, b] in draw order per row
        draw_probs = draft_probs.gather(1, draw_tokens).tolist()  # [f, b] q of each draw
        num_possible = (draft_probs > 0).sum(dim=-1).tolist()  # [f] tokens q can draw at all
        chosen: list[tuple[int, int, float]] = []
        served = sorted(range(len(self.frontier)), key=lambda j: -self._path_logq_of(self.frontier[j]))
        for j, tokens in zip(served, draw_tokens[served].tolist(), strict=True):
            num_children = min(num_top, num_new - len(chosen), num_possible[j])
            if num_children <= 0:
                continue
            parent = self.frontier[j]
            self._draft_rows[parent] = draft_probs[j].clone()  # [V], the caller may reuse its buffer
            base = self._path_logq_of(parent)
            for token, prob in zip(tokens[:num_children], draw_probs[j][:num_children], strict=True):
                chosen.append((parent, token, base + math.log(prob)))
        return chosen

    def build(self) -> tuple[TokenTree, torch.Tensor | None]:
        """The tree, and the draft distributions for verify_tree ([n + 1, V]; None in greedy mode).

        Callable at any level: the partial tree gives the draft pass its attention mask and positions.

        Row 0 is the q the root's children were drawn from, row i + 1 node i's; rows of leaves are zeros.
        """
        device = self._device
        tree = TokenTree(
            tokens=torch.tensor(self._tokens, dtype=torch.long, device=device),
            parents=torch.tensor(self._parents, dtype=torch.long, device=device),
        )
        if self.is_greedy or not self._draft_rows:
            return tree, None
        some_row = next(iter(self._draft_rows.values()))
        draft_probs = torch.zeros(self.num_nodes + 1, some_row.shape[0], dtype=some_row.dtype, device=device)
        for node, q in self._draft_rows.items():
            draft_probs[node + 1] = q
        return tree, draft_probs
