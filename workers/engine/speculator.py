"""Speculative decoding inside continuous batching: who speculates how much, proposing, verifying.

Per step, for every decoding sequence that speculates: `lookahead` (asked by the scheduler) decides its
k (or tree size) from its own acceptance and the batch; `propose` runs the n-gram index or the draft model;
the engine scores everything in ONE target forward; `verify` accepts. The speculator reads sequences and
returns values (ProposeOutput, Verdicts): the engine applies them (workers/engine/apply.py). A failing draft
makes its sequences fall back to plain decoding (the engine counts it) and the step goes on.
"""

import logging
import time
from dataclasses import dataclass, field

import torch

from shared.speculation import SpeculativeMethod
from workers.engine.config import EngineConfig
from workers.engine.draft_proposer import DraftProposer
from workers.engine.eagle_proposer import EagleProposer
from workers.engine.errors import InvalidRequestError
from workers.engine.sampling_params import SamplingParams
from workers.engine.scheduler_output import ScheduledSeq
from workers.engine.sequence import Sequence
from workers.spec.adaptive import AdaptiveConfig, SpecLengthController, batch_k_limit
from workers.spec.ngram import NgramIndex
from workers.spec.proposal import Proposal, Verdict
from workers.spec.state import SpecState, SpecStats
from workers.spec.verify_batch import VerifyEntry, verify_batch

log = logging.getLogger(__name__)


@dataclass
class ProposeOutput:
    """What proposing returns for one step; the engine applies it before the target forward."""

    # request_id -> its proposal; a draft-model proposal may hold no tokens (its draft_num_computed still applies)
    proposals: dict[str, Proposal] = field(default_factory=dict)
    fallbacks: dict[str, str] = field(default_factory=dict)  # request_id -> why it stops speculating for good

    @property
    def to_verify(self) -> dict[str, Proposal]:
        """request_id -> the proposals with at least one token: the draft tokens the target scores this step."""
        return {rid: p for rid, p in self.proposals.items() if p.num_tokens}


class Speculator:
    def __init__(
        self, cfg: EngineConfig, draft: DraftProposer | None, max_model_len: int, eagle: EagleProposer | None = None
    ) -> None:
        self.cfg = cfg
        self.draft = draft
        self.eagle = eagle
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
        self.stats = SpecStats()  # engine-wide figures; draft time here, the rest where the engine applies

    def new_state(self, params: SamplingParams, prompt_ids: list[int]) -> SpecState | None:
        method = SpeculativeMethod(params.speculative or self.cfg.speculative_method)
        if method is SpeculativeMethod.NONE:
            return None
        if method is SpeculativeMethod.DRAFT and self.draft is None:
            raise InvalidRequestError("speculative", "this engine has no draft model; use 'ngram' or 'none'")
        if method is SpeculativeMethod.EAGLE and self.eagle is None:
            raise InvalidRequestError("speculative", "this engine has no EAGLE head (eagle_dir); use 'ngram' or 'none'")
        ngram = None
        if method is SpeculativeMethod.NGRAM:
            ngram = NgramIndex(self.cfg.ngram_min_n, self.cfg.ngram_max_n)
            ngram.extend(prompt_ids)
        controller = SpecLengthController(self.adaptive)
        if not self.cfg.is_adaptive:
            controller.k = self.cfg.num_speculative_tokens
        return SpecState(method=method, controller=controller, ngram=ngram)

    def uses_tree(self, spec: SpecState) -> bool:
        return spec.method in (SpeculativeMethod.DRAFT, SpeculativeMethod.EAGLE) and self.cfg.tree_size > 0

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

    def propose(self, speculating: list[ScheduledSeq]) -> ProposeOutput:
        """Up to num_lookahead draft tokens for each entry; reads the sequences, writes none of them."""
        out = ProposeOutput()
        by_draft: list[ScheduledSeq] = []
        by_eagle: list[ScheduledSeq] = []
        for s in speculating:
            assert s.seq.spec is not None
            if s.seq.spec.ngram is not None:
                tokens = s.seq.spec.ngram.propose(s.num_lookahead)
                if tokens:
                    out.proposals[s.request_id] = Proposal(tokens, None)
            elif s.seq.spec.method is SpeculativeMethod.EAGLE:
                by_eagle.append(s)
            else:
                by_draft.append(s)
        for proposer, entries, reason in ((self.draft, by_draft, "draft_error"), (self.eagle, by_eagle, "head_error")):
            if entries:
                assert proposer is not None
                start_s = time.perf_counter()
                self._propose_with(proposer, entries, out, reason)
                elapsed_s = time.perf_counter() - start_s
                self.stats.draft_time_s += elapsed_s
                self.stats.by_method(entries[0].seq.spec.method).draft_time_s += elapsed_s  # type: ignore[union-attr]
        return out

    def _propose_with(
        self, proposer: DraftProposer | EagleProposer, entries: list[ScheduledSeq], out: ProposeOutput, reason: str
    ) -> None:
        """Full-size token trees where the budget allows one, chains for the rest (see lookahead)."""
        tree_size = self.cfg.tree_size
        by_shape: dict[bool, list[ScheduledSeq]] = {True: [], False: []}  # is a tree -> entries
        for s in entries:
            by_shape[bool(tree_size) and s.num_lookahead >= tree_size].append(s)
        made: dict[str, Proposal] = {}
        try:
            for is_tree, group in by_shape.items():
                if not group:
                    continue
                seqs, sizes = [s.seq for s in group], [s.num_lookahead for s in group]
                if is_tree:
                    proposed = proposer.propose_trees(seqs, sizes, self.cfg.tree_branching)
                else:
                    proposed = proposer.propose_chains(seqs, sizes)
                made.update((s.request_id, p) for s, p in zip(group, proposed, strict=True))
        except Exception:  # a broken draft must not lose the jobs: they continue with plain decoding
            log.exception("%s: %d sequences fall back to plain decoding", reason, len(entries))
            out.fallbacks.update((s.request_id, reason) for s in entries)
            return
        out.proposals.update(made)

    # ---- after the forward ----------------------------------------------------------------------
    def verify(self, entries: list[VerifyEntry], logits: torch.Tensor) -> list[Verdict]:
        """logits: [S, V], each entry's 1 + num_tokens rows in order."""
        return verify_batch(entries, logits)
