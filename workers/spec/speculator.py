"""Speculative decoding inside continuous batching: who speculates how much, proposing, verifying, committing.

Per step, for every decoding sequence that speculates: `lookahead` (asked by the scheduler) decides its
k (or tree size) from its own acceptance and the batch; `propose` runs the n-gram index or the draft model;
the engine scores everything in ONE target forward; `verify` accepts; `commit` rolls the draft/n-gram
state forward and moves accepted tree K/V into place. A failing draft makes its sequences fall back to
plain decoding (counted) and the step goes on.
"""

import logging
import time

import torch

from shared.speculation import SpeculativeMethod
from workers.engine.config import EngineConfig
from workers.engine.errors import InvalidRequestError
from workers.engine.model_runner import ModelRunner
from workers.engine.sampling_params import SamplingParams
from workers.engine.sequence import Sequence
from workers.spec.adaptive import AdaptiveConfig, SpecLengthController, batch_k_limit
from workers.spec.draft_proposer import DraftProposer
from workers.spec.ngram import NgramIndex
from workers.spec.proposal import Proposal, Verdict
from workers.spec.state import SpecState, SpecStats
from workers.spec.verify_batch import verify_batch

log = logging.getLogger(__name__)


class Speculator:
    def __init__(self, cfg: EngineConfig, target: ModelRunner, draft: DraftProposer | None, max_model_len: int) -> None:
        self.cfg = cfg
        self.target = target
        self.draft = draft
        self.max_model_len = max_model_len
        self.adaptive = AdaptiveConfig(
            k_min=cfg.speculative_k_min,
            k_max=cfg.num_speculative_tokens,
            draft_cost_per_token=cfg.spec_draft_cost_per_token,
            fallback_acceptance=cfg.spec_fallback_acceptance,
            fallback_patience_steps=cfg.spec_fallback_patience_steps,
            batch_token_budget=cfg.spec_batch_token_budget,
            max_spec_batch_size=cfg.spec_max_batch_size,
        )
        self.stats = SpecStats()

    def new_state(self, params: SamplingParams, prompt_ids: list[int]) -> SpecState | None:
        method = SpeculativeMethod(params.speculative or self.cfg.speculative_method)
        if method is SpeculativeMethod.NONE:
            return None
        if method is SpeculativeMethod.DRAFT and self.draft is None:
            raise InvalidRequestError("speculative", "this engine has no draft model; use 'ngram' or 'none'")
        ngram = None
        if method is SpeculativeMethod.NGRAM:
            ngram = NgramIndex(self.cfg.ngram_min_n, self.cfg.ngram_max_n)
            ngram.extend(prompt_ids)
        controller = SpecLengthController(self.adaptive)
        if not self.cfg.is_adaptive:
            controller.k = self.cfg.num_speculative_tokens
        return SpecState(method=method, controller=controller, ngram=ngram)

    def uses_tree(self, spec: SpecState) -> bool:
        return spec.method is SpeculativeMethod.DRAFT and self.cfg.tree_size > 0

    # ---- before the forward ---------------------------------------------------------------------
    def lookahead(self, seq: Sequence, batch_size: int) -> int:
        """Draft tokens (tree: nodes) this decoding sequence verifies this step; 0 = plain decoding."""
        spec = seq.spec
        if spec is None or not spec.is_active:
            return 0
        # a seeded sampling request keeps its own k whatever the batch, so its draws stay reproducible
        is_batch_free = seq.params.seed is not None and not seq.params.is_greedy
        if self.uses_tree(spec):  # a tree's nodes share the batch's spare target tokens like chain tokens do
            tree_size = self.cfg.tree_size
            limit = tree_size if is_batch_free else batch_k_limit(self.adaptive, batch_size, batch_size, tree_size)
            # a tree cut below its size spends its few nodes on siblings: a chain uses them better
            want = limit if limit >= tree_size else spec.controller.k_for_step(min(limit, self.adaptive.k_max))
        else:
            limit = self.adaptive.k_max if is_batch_free else batch_k_limit(self.adaptive, batch_size, batch_size)
            want = spec.controller.k_for_step(limit)
        useful = seq.params.max_tokens - seq.num_output_tokens - 1  # the step adds one token on top
        return max(0, min(want, useful, self.max_model_len - len(seq)))

    def propose(self, seqs: list[Sequence], sizes: list[int]) -> dict[str, Proposal]:
        proposals: dict[str, Proposal] = {}
        by_draft: list[tuple[Sequence, int]] = []
        for seq, size in zip(seqs, sizes, strict=True):
            assert seq.spec is not None
            if seq.spec.ngram is not None:
                tokens = seq.spec.ngram.propose(size)
                if tokens:
                    proposals[seq.request_id] = Proposal(tokens, None)
            else:
                by_draft.append((seq, size))
        if by_draft:
            start_s = time.perf_counter()
            proposals.update(self._propose_with_draft(by_draft))
            self.stats.draft_time_s += time.perf_counter() - start_s
        return proposals

    def _propose_with_draft(self, entries: list[tuple[Sequence, int]]) -> dict[str, Proposal]:
        """Full-size token trees where the budget allows one, chains for the rest (see lookahead)."""
        assert self.draft is not None
        tree_size = self.cfg.tree_size
        by_shape: dict[bool, list[tuple[Sequence, int]]] = {True: [], False: []}  # is a tree -> entries
        for seq, size in entries:
            by_shape[bool(tree_size) and size >= tree_size].append((seq, size))
        made: list[tuple[Sequence, Proposal]] = []
        try:
            for is_tree, group in by_shape.items():
                if not group:
                    continue
                seqs, sizes = [seq for seq, _ in group], [size for _, size in group]
                if is_tree:
                    proposed = self.draft.propose_trees(seqs, sizes, self.cfg.tree_branching)
                else:
                    proposed = self.draft.propose_chains(seqs, sizes)
                made += zip(seqs, proposed, strict=True)
        except Exception:  # a broken draft must not lose the jobs: they continue with plain decoding
            log.exception("draft proposer failed; %d sequences fall back to plain decoding", len(entries))
            for seq, _ in entries:
                self._fall_back(seq, "draft_error")
            return {}
        return {seq.request_id: p for seq, p in made if p.num_tokens}

    # ---- after the forward ----------------------------------------------------------------------
    def verify(self, entries: list[tuple[Sequence, Proposal | None]], logits: torch.Tensor) -> list[Verdict]:
        """logits: [S, V], each entry's 1 + num_tokens rows in order."""
        return verify_batch(entries, logits)

    def commit(self, seq: Sequence, proposal: Proposal | None, verdict: Verdict, old_len: int, appended: list[int]) -> None:
        """Roll speculation state forward after `appended` (the verdict's tokens, cut at a stop) joined seq."""
        spec = seq.spec
        if spec is None:
            return
        if spec.ngram is not None:
            spec.ngram.extend(appended)
        if proposal is None:
            return
        if verdict.accepted_nodes:
            self._move_tree_kv(seq, old_len, verdict.accepted_nodes)
        if proposal.tree is None and spec.method is SpeculativeMethod.DRAFT:
            spec.draft_num_computed = min(spec.draft_num_computed, old_len + verdict.num_accepted)
        else:
            spec.draft_num_computed = min(spec.draft_num_computed, old_len)
        spec.counts.record(proposal.num_tokens, verdict.num_accepted, proposal.depth)
        self.stats.record(proposal.num_tokens, verdict.num_accepted, proposal.depth)
        if self.cfg.is_adaptive and proposal.tree is None:
            if spec.controller.update(proposal.num_tokens, verdict.num_accepted):
                self._fall_back(seq, "low_acceptance")

    def _move_tree_kv(self, seq: Sequence, old_len: int, path: list[int]) -> None:
        """Accepted node i sat in slot old_len + node; it belongs in slot old_len + depth."""
        moves = [(old_len + node, old_len + depth) for depth, node in enumerate(path) if node != depth]
        if moves:
            self.target.copy_slots(
                [self.target.slot(seq.block_table, src) for src, _ in moves],
                [self.target.slot(seq.block_table, dst) for _, dst in moves],
            )

    def _fall_back(self, seq: Sequence, reason: str) -> None:
        assert seq.spec is not None
        if seq.spec.is_active:
            seq.spec.fall_back(reason)
            self.stats.num_fallbacks += 1
