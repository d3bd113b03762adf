"""Speculative verification as pure functions: which draft tokens the target keeps, and the one it adds.

Terms (as in vLLM's rejection sampler):
- *draft tokens*: the k tokens a proposer (draft model, n-gram lookup) guessed after the last committed token.
- *accepted tokens*: the draft tokens the target keeps - a prefix of the chain, a root-to-node path of a tree.
- *recovered token*: the target's replacement at the first rejected position: its argmax (greedy) or a
  draw from the residual normalize(max(0, p - q)) (sampling).
- *bonus token*: when all draft tokens down to a leaf are accepted, one more token from the target's
  distribution after the last of them; free, since the verifying pass computed that row anyway.
Every step emits the accepted tokens plus exactly one recovered or bonus token.

Distributions: p is the target's, q the draft's, both from workers.spec.distributions.row_distributions with
the request's temperature/top-k/top-p (the same transform on both, or the output would follow the wrong p).
Row i of target_probs is p after committed tokens + draft tokens 0..i-1, so a chain of k has k + 1 rows. In
greedy mode only the argmax of each target row is read: one-hot rows from logits_to_probs or raw logits both
work, and the output is the target's own greedy decoding token for token. A proposer without a distribution
(n-gram) passes draft_probs=None: q is one-hot at the proposed token, so x is accepted with probability p(x)
and the residual is p with x removed.

Randomness: a sequence's draws come only from its own generator (the global one when None), in a fixed
order: one uniform per draft token (per tree node), then V Exp(1) variables for the final token, drawn as
argmax(weights / exp) (the exponential race: P(token = v) = weights[v] / sum(weights), no normalisation
needed). Greedy sequences draw nothing. So a seeded request's output does not depend on its batch company,
and verify_chain, verify_chains and verify_tree (on a chain) give identical tokens for the same seed.
"""

from dataclasses import dataclass

import torch

from workers.spec.tree import ROOT, TokenTree

_MIN_EXP = 1e-20  # Exp(1) draws are clamped away from 0 so weights / exp stays finite


@dataclass
class ChainResult:
    num_accepted: int  # accepted draft tokens, 0..k
    tokens: list[int]  # [num_accepted + 1]: the accepted tokens, then the recovered or bonus token


@dataclass
class TreeResult:
    accepted_nodes: list[int]  # root-to-node path of accepted node indices
    tokens: list[int]  # [len(accepted_nodes) + 1]: their tokens, then the recovered or bonus token

    @property
    def num_accepted(self) -> int:
        return len(self.accepted_nodes)


def _draw_uniform(num: int, generator: torch.Generator | None, device: torch.device) -> torch.Tensor:  # [num]
    return torch.rand(num, generator=generator, device=device)


def _draw_exponential(vocab: int, generator: torch.Generator | None, device: torch.device) -> torch.Tensor:  # [V]
    return torch.empty(vocab, device=device).exponential_(generator=generator).clamp_min_(_MIN_EXP)


def _race(weights: torch.Tensor, exponential: torch.Tensor) -> torch.Tensor:  # [..., V] each -> [...] long
    """A draw from normalize(weights) per row, given Exp(1) noise of the same shape."""
    return (weights / exponential).argmax(dim=-1)


def _residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:  # [..., V] each -> [..., V], unnormalised
    """max(0, p - q): where the target wants more mass than the draft offered. Falls back to p when empty
    (p == q up to rounding, so a rejection had probability ~0)."""
    residual = (p - q).clamp_min(0.0)
    return torch.where(residual.sum(dim=-1, keepdim=True) > 0.0, residual, p)


def _one_hot(token: torch.Tensor, vocab: int) -> torch.Tensor:  # token: [...] long -> [..., V] float
    return torch.nn.functional.one_hot(token, vocab).float()


def _num_leading_true(flags: torch.Tensor) -> torch.Tensor:  # [..., k] bool -> [...] long
    return flags.long().cumprod(dim=-1).sum(dim=-1)


def verify_chain(
    draft_tokens: torch.Tensor,  # [k] long
    draft_probs: torch.Tensor | None,  # [k, V] q at each draft position; None = one-hot (n-gram)
    target_probs: torch.Tensor,  # [k + 1, V] p at each draft position, then after the last draft token
    generator: torch.Generator | None,
    is_greedy: bool,
) -> ChainResult:
    """Verify one sequence's chain of k draft tokens (k = 0 is plain decoding from row 0)."""
    num_draft, vocab = draft_tokens.shape[0], target_probs.shape[1]
    if target_probs.shape[0] != num_draft + 1:
        raise ValueError(f"target_probs needs k + 1 = {num_draft + 1} rows, got {target_probs.shape[0]}")
    positions = torch.arange(num_draft, device=target_probs.device)  # [k]
    if is_greedy:
        target_argmax = target_probs.argmax(dim=-1)  # [k + 1]
        num_accepted = int(_num_leading_true(draft_tokens == target_argmax[:num_draft]))
        final_token = int(target_argmax[num_accepted])  # recovered if num_accepted < k, else bonus
        return ChainResult(num_accepted, draft_tokens[:num_accepted].tolist() + [final_token])

    uniform = _draw_uniform(num_draft, generator, target_probs.device)  # [k]
    exponential = _draw_exponential(vocab, generator, target_probs.device)  # [V]
    p_draft = target_probs[positions, draft_tokens]  # [k] p(x_i)
    q_draft = torch.ones_like(p_draft) if draft_probs is None else draft_probs[positions, draft_tokens]  # [k] q(x_i)
    # accept x_i with probability min(1, p(x_i) / q(x_i)), i.e. iff u * q(x_i) < p(x_i):
    # p(x) >= q(x): always accept; p(x) = 0: never accept (strict <)
    is_accepted = uniform * q_draft < p_draft  # [k]
    num_accepted = int(_num_leading_true(is_accepted))
    p_final = target_probs[num_accepted]  # [V]
    if num_accepted == num_draft:
        weights = p_final  # bonus: a draw from p after the last draft token
    else:
        rejected = draft_tokens[num_accepted]
        q_final = _one_hot(rejected, vocab) if draft_probs is None else draft_probs[num_accepted]  # [V]
        weights = _residual(p_final, q_final)  # recovered: a draw from normalize(max(0, p - q))
    final_token = int(_race(weights, exponential))
    return ChainResult(num_accepted, draft_tokens[:num_accepted].tolist() + [final_token])


def verify_chains(
    draft_tokens: torch.Tensor,  # [T] long, every sequence's draft tokens concatenated (T = sum of k_b)
    num_draft_tokens: list[int],  # [B] k_b per sequence (0 = plain decoding)
    draft_probs: torch.Tensor | None,  # [T, V] q per draft token; None = one-hot for all (n-gram)
    target_probs: torch.Tensor,  # [T + B, V] k_b + 1 rows per sequence, sequences in order
    generators: list[torch.Generator | None],  # [B] per-request generator, None = the global one
    is_greedy: list[bool],  # [B]
) -> list[ChainResult]:
    """Batched verify_chain: one argmax, one gather and one race for the batch, one host sync at the end.

    A seeded sequence draws from its own generator exactly as verify_chain does, so its tokens equal
    verify_chain's whatever the batch; unseeded sequences share draws from the global generator. To mix
    proposers in one batch, give the rows of those without a distribution as one-hot at their token:
    that is exactly what draft_probs=None means.
    """
    device, vocab, num_seqs = target_probs.device, target_probs.shape[1], len(num_draft_tokens)
    total_draft = draft_tokens.shape[0]
    if sum(num_draft_tokens) != total_draft or target_probs.shape[0] != total_draft + num_seqs:
        raise ValueError(f"shapes disagree: T={total_draft}, sum(k)={sum(num_draft_tokens)}, rows={target_probs.shape[0]}")
    if not num_seqs:
        return []
    num_draft = torch.tensor(num_draft_tokens, device=device)  # [B]
    draft_start = torch.cumsum(num_draft, dim=0) - num_draft  # [B] first draft index of each sequence
    target_start = draft_start + torch.arange(num_seqs, device=device)  # [B] first target row
    max_draft = max(num_draft_tokens)
    position = torch.arange(max_draft, device=device).unsqueeze(0)  # [1, K]
    is_valid = position < num_draft.unsqueeze(1)  # [B, K]
    draft_index = (draft_start.unsqueeze(1) + position).clamp(max=max(total_draft - 1, 0))  # [B, K]
    target_index = target_start.unsqueeze(1) + torch.minimum(position, num_draft.unsqueeze(1))  # [B, K] pads: last row
    tokens = draft_tokens[draft_index] if total_draft else torch.zeros_like(draft_index)  # [B, K] padded
    is_greedy_seq = torch.tensor(is_greedy, device=device)  # [B]

    target_argmax = target_probs.argmax(dim=-1)  # [T + B]
    is_match = tokens == target_argmax[target_index]  # [B, K] greedy acceptance
    uniform, exponential = _draw_batch(num_draft_tokens, vocab, generators, is_greedy, device)  # [B, K], [B, V]
    p_draft = target_probs[target_index, tokens]  # [B, K] p(x_i)
    if draft_probs is None:
        q_draft = torch.ones_like(p_draft)  # [B, K]
    else:
        q_draft = draft_probs[draft_index, tokens] if total_draft else torch.ones_like(p_draft)  # [B, K] q(x_i)
    # accept x_i iff u * q(x_i) < p(x_i) (prob min(1, p/q)); p(x) >= q(x): always; p(x) = 0: never
    is_accepted = torch.where(is_greedy_seq.unsqueeze(1), is_match, uniform * q_draft < p_draft) & is_valid  # [B, K]
    num_accepted = _num_leading_true(is_accepted) if max_draft else torch.zeros_like(num_draft)  # [B]

    p_final = target_probs[target_start + num_accepted]  # [B, V]
    is_rejected = num_accepted < num_draft  # [B]
    if not total_draft:
        q_final = torch.zeros_like(p_final)  # [B, V]
    else:
        rejected_index = (draft_start + num_accepted).clamp(max=total_draft - 1)  # [B]
        if draft_probs is None:
            q_final = _one_hot(draft_tokens[rejected_index], vocab)  # [B, V]
        else:
            q_final = draft_probs[rejected_index].float()  # [B, V]
        q_final = q_final * is_rejected.unsqueeze(1)  # bonus rows: q = 0, so the residual is p itself
    sampled = _race(_residual(p_final, q_final), exponential)  # [B] recovered or bonus draws
    final_token = torch.where(is_greedy_seq, target_argmax[target_start + num_accepted], sampled)  # [B]

    packed = torch.cat([num_accepted.unsqueeze(1), tokens, final_token.unsqueeze(1)], dim=1)  # [B, K + 2]
    results = []
    for n, *row in packed.tolist():  # the one host sync
        results.append(ChainResult(n, row[:n] + [row[-1]]))
    return results


def _draw_batch(
    num_draft_tokens: list[int],  # [B]
    vocab: int,
    generators: list[torch.Generator | None],  # [B]
    is_greedy: list[bool],  # [B]
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:  # uniform [B, K], exponential [B, V]
    """Per-sequence draws in verify_chain's order; unseeded sampling sequences share one global draw each."""
    num_seqs, max_draft = len(num_draft_tokens), max(num_draft_tokens)
    uniform = torch.zeros(num_seqs, max_draft, device=device)  # [B, K]
    exponential = torch.ones(num_seqs, vocab, device=device)  # [B, V]; greedy rows unused
    unseeded = [b for b in range(num_seqs) if not is_greedy[b] and generators[b] is None]
    for b in range(num_seqs):
        generator = generators[b]
        if is_greedy[b] or generator is None:
            continue
        uniform[b, : num_draft_tokens[b]] = _draw_uniform(num_draft_tokens[b], generator, device)
        exponential[b] = _draw_exponential(vocab, generator, device)
    if unseeded:
        index = torch.tensor(unseeded, device=device)  # [U]
        uniform[index] = torch.rand(len(unseeded), max_draft, device=device)
        exponential[index] = torch.empty(len(unseeded), vocab, device=device).exponential_().clamp_min_(_MIN_EXP)
    return uniform, exponential


def verify_tree(
    tree: TokenTree,  # n nodes
    draft_probs: torch.Tensor | None,  # [n + 1, V] row node + 1 = q node's children were drawn from; None = deterministic
    target_probs: torch.Tensor,  # [n + 1, V] row 0 = p after the last committed token, row i + 1 = p after node i
    generator: torch.Generator | None,
    is_greedy: bool,
) -> TreeResult:
    """Verify one sequence's token tree; returns the accepted root-to-node path and the emitted tokens.

    Greedy: from the root, follow the child whose token is the target's argmax; where none matches, emit the
    argmax (recovered), or at a leaf the argmax after it (bonus).

    Sampling - recursive rejection sampling (the idea of SpecInfer, Miao et al. 2023, and of Recursive
    Speculative Decoding, Jeon et al. 2024). At a node with target p and children x_1..x_m drawn from q
    without replacement (x_i ~ q_i = q with x_1..x_{i-1} removed, renormalised), set p_1 = p and for i = 1..m:
    accept x_i with probability min(1, p_i(x_i) / q_i(x_i)) and descend into it; on rejection
    p_{i+1} = normalize(max(p_i - q_i, 0)). If all are rejected, draw the recovered token from p_{m+1}.

    Why the emitted token is distributed as p (backward induction over i): suppose that, whatever happened
    before stage i+1, stages i+1.. emit a token distributed as p_{i+1}. At stage i, x_i ~ q_i is emitted at
    value y with probability q_i(y) min(1, p_i(y)/q_i(y)) = min(p_i, q_i)(y); a rejection has total
    probability beta = sum(max(p_i - q_i, 0)), and p_{i+1} = max(p_i - q_i, 0) / beta does not depend on
    which x_i was rejected. So stage i emits y with probability
    min(p_i, q_i)(y) + beta * max(p_i - q_i, 0)(y) / beta = p_i(y). The last stage (a plain draw from
    p_{m+1}) starts the induction, and stage 1 gives p_1 = p. Drawing without replacement costs nothing in
    correctness and avoids waste: a rejected x_i has p_i(x_i) < q_i(x_i), so p_{i+1}(x_i) = 0 and a
    duplicate could never be accepted. The argument needs each x_i to be a fresh draw from q_i given the
    past, so the number of children must not depend on their own values (TreeBuilder guarantees it). With
    draft_probs None each child is a deterministic proposal, q_i one-hot at x_i: accept with p_i(x_i),
    else remove x_i from p_i - the same induction. Along the accepted path each emitted token follows the
    target's conditional distribution given the tokens before it, so the output is distributed as the
    target's own sampling.
    """
    vocab = target_probs.shape[1]
    if target_probs.shape[0] != tree.num_nodes + 1:
        raise ValueError(f"target_probs needs n + 1 = {tree.num_nodes + 1} rows, got {target_probs.shape[0]}")
    tokens = tree.tokens.tolist()
    if is_greedy:
        target_argmax = target_probs.argmax(dim=-1).tolist()  # [n + 1]
        path: list[int] = []
        node = ROOT
        while True:
            wanted = target_argmax[node + 1]
            matches = [child for child in tree.children(node) if tokens[child] == wanted]
            if not matches:
                return TreeResult(path, [tokens[n] for n in path] + [wanted])
            node = matches[0]
            path.append(node)

    uniform = _draw_uniform(tree.num_nodes, generator, target_probs.device).tolist()  # [n] one per node
    exponential = _draw_exponential(vocab, generator, target_probs.device)  # [V]
    path = []
    node = ROOT
    while True:
        weights, accepted_child = _verify_children(tree, node, tokens, uniform, draft_probs, target_probs)
        if accepted_child is None:
            final_token = int(_race(weights, exponential))
            return TreeResult(path, [tokens[n] for n in path] + [final_token])
        node = accepted_child
        path.append(node)


def _verify_children(
    tree: TokenTree,
    node: int,
    tokens: list[int],  # [n]
    uniform: list[float],  # [n]
    draft_probs: torch.Tensor | None,  # [n + 1, V]
    target_probs: torch.Tensor,  # [n + 1, V]
) -> tuple[torch.Tensor, int | None]:  # (weights [V] for the final draw, accepted child or None)
    """One node of recursive rejection sampling: try its children in draw order."""
    vocab = target_probs.shape[1]
    weights = target_probs[node + 1]  # [V] p_i, unnormalised after a rejection
    q = None if draft_probs is None else draft_probs[node + 1].float()  # [V] q_i
    for i, child in enumerate(tree.children(node)):
        x = tokens[child]
        p = weights if i == 0 else weights / weights.sum()  # [V] p_i
        q_x = 1.0 if q is None else float(q[x])
        # accept x_i with probability min(1, p_i(x_i) / q_i(x_i)); p(x) >= q(x): always; p(x) = 0: never
        if uniform[child] * q_x < float(p[x]):
            return weights, child
        q_i = _one_hot(torch.tensor(x, device=p.device), vocab) if q is None else q  # [V]
        weights = _residual(p, q_i)  # p_{i+1}, unnormalised
        if q is not None:
            q = q.clone()
            q[x] = 0.0  # q_{i+1}: without replacement
            q_mass = q.sum()
            q = q / q_mass if float(q_mass) > 0.0 else q
    return weights, None
