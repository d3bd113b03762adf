"""Speculative decoding inside continuous batching: who speculates how much, proposing, verifying.

Per step, for the decoding sequences that speculate: `plan_lookahead` (asked by the scheduler) chooses
each one's k (or tree) from its acceptance and the pass costs measured on this host (workers/spec/
length_policy.py; the tables are fed by every forward the runners time); `propose` runs the n-gram index or
the draft model;
the engine scores everything in ONE target forward; `verify` accepts. The speculator reads sequences and
returns values (ProposeOutput, Verdicts): the engine applies them (workers/engine/apply.py). A failing draft
makes its sequences fall back to plain decoding (the engine counts it) and the step goes on.
"""

import logging
import time
from collections.abc import Callable
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
from workers.spec.adaptive import AdaptiveConfig, PooledAcceptance, SpecLengthController
from workers.spec.goodput_guard import GoodputGuard, Key, guard_key
from workers.spec.length_policy import Candidate, choose_lengths
from workers.spec.ngram import NgramIndex
from workers.spec.pass_costs import AttentionWork, PassCostTable, PassTiming
from workers.spec.proposal import Proposal, Verdict
from workers.spec.proposal_timing import ProposalPasses
from workers.spec.replan import Replan, probe_picks
from workers.spec.row_max import RowMax, torch_row_max
from workers.spec.state import SpecState, SpecStats
from workers.spec.step_overhead import StepOverhead
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
        self,
        cfg: EngineConfig,
        draft: DraftProposer | None,
        max_model_len: int,
        eagle: EagleProposer | None = None,
        row_max: RowMax = torch_row_max,  # greedy verification's argmax (the engine's is native where it can be)
    ) -> None:
        self.cfg = cfg
        self.row_max = row_max
        self.draft = draft
        self.eagle = eagle
        self.max_model_len = max_model_len
        self.adaptive = AdaptiveConfig(
            k_min=cfg.speculative_k_min,
            k_max=cfg.num_speculative_tokens,
            draft_cost_per_token=cfg.spec_draft_cost_per_token,
            fallback_acceptance=cfg.spec_fallback_acceptance,
            fallback_patience_steps=cfg.spec_fallback_patience_steps,
        )
        self.stats = SpecStats()  # engine-wide figures; draft time here, the rest where the engine applies
        # pass costs measured on this host (the engine probes them at start-up, then every forward feeds them)
        self.target_costs = PassCostTable(max_tokens=cfg.max_num_batched_tokens)
        self.proposer_costs: dict[str, PassCostTable] = {}  # proposer -> its passes; n-gram lookup has none
        for method, proposer in ((SpeculativeMethod.DRAFT, draft), (SpeculativeMethod.EAGLE, eagle)):
            if proposer is not None:
                self.proposer_costs[method.value] = PassCostTable(max_tokens=cfg.max_num_batched_tokens)
        # decoding sequences in the step -> [steps planned, draft tokens chosen]: what the policy does per batch
        self.chosen_by_batch: dict[int, list[int]] = {}
        self.step_overhead = StepOverhead()  # a step's work outside its passes, measured (step_overhead.py)
        self.pooled_acceptance: dict[SpeculativeMethod, PooledAcceptance] = {}  # method -> its sequences' acceptance
        self.guard = GoodputGuard()  # speculation vetoed where it realised less than plain steps (goodput_guard.py)
        self.replan = Replan()  # a batch whose plans keep drafting nothing is planned less often (replan.py)
        self._guard_key: Key | None = None  # the current step's key, once it was planned
        # the decode steps of the last planned batch's size are vetoed or quiet (their plans draft nothing): prompts
        # are not taken in by the proposers (prefill), whose intake would buy nothing at such a batch
        self._is_intake_paused = False
        self._step_pass_s = 0.0  # the current step's passes so far
        self._step_ran_new_shape = False  # one of them was a runner's first of its shape (PassTiming)
        self._proposal_passes = ProposalPasses(self._add_pass)  # a proposer pass: its forward + its draw work

    # ---- what passes and steps cost (fed by the runners and the engine) ---------------------------
    def observe_target_pass(self, timing: PassTiming) -> None:
        if not timing.is_first_of_shape:
            self.target_costs.observe(timing.num_tokens, timing.seconds, timing.work)
        self._add_pass(timing)

    def proposer_pass_observer(self, method: SpeculativeMethod) -> Callable[[PassTiming], None]:
        table = self.proposer_costs[method.value]

        def observe(timing: PassTiming) -> None:
            self._proposal_passes.observe(table, timing)

        return observe

    def _add_pass(self, timing: PassTiming) -> None:
        self._step_pass_s += timing.seconds
        self._step_ran_new_shape |= timing.is_first_of_shape

    def begin_step(self) -> None:
        self._step_pass_s = 0.0
        self._step_ran_new_shape = False
        self._guard_key = None

    def end_step(self, step_s: float, num_seqs: int, num_speculating: int, num_tokens: int) -> None:
        """The step took step_s and emitted num_tokens: what its passes did not take is its overhead
        (step_overhead.py); a step that was planned tells the guard what its kind delivered. A step with a
        pass of a shape its runner never ran before measures nothing: that pass's one-time set-up (~4 ms on
        the demo target) is not what such steps cost. Left in, it made the rare speculative steps of a batch
        that mostly decodes plainly look 4x dearer than plain ones - every one of them brought new shapes - so
        the policy kept that batch plain, its shapes stayed new, and EAGLE trees at 32 sequences settled at
        0.83-0.93x plain decoding instead of drafting."""
        if self._step_ran_new_shape:
            return
        self.step_overhead.observe(step_s - self._step_pass_s, num_seqs, num_speculating)
        if self._guard_key is not None:
            self.guard.observe(self._guard_key, num_speculating > 0, num_tokens, step_s)

    def new_state(self, params: SamplingParams, prompt_ids: list[int]) -> SpecState | None:
        method = SpeculativeMethod(params.speculative or self.cfg.speculative_method or SpeculativeMethod.NONE)
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
        # a seeded sampling request's lengths come from its own draws alone: no pooled prior (adaptive.py)
        controller = SpecLengthController(self.adaptive, None if params.is_seeded_sampling else self._pool(method))
        if not self.cfg.is_adaptive:
            controller.k = self.cfg.num_speculative_tokens
        return SpecState(method=method, controller=controller, ngram=ngram)

    def _pool(self, method: SpeculativeMethod) -> PooledAcceptance:
        """The pooled acceptance of `method`'s sequences, the prior each new one starts from."""
        pool = self.pooled_acceptance.get(method)
        if pool is None:
            pool = self.pooled_acceptance[method] = PooledAcceptance(self.adaptive.initial_acceptance)
        return pool

    def uses_tree(self, spec: SpecState) -> bool:
        return spec.method in (SpeculativeMethod.DRAFT, SpeculativeMethod.EAGLE) and self.cfg.tree_size > 0

    # ---- before the forward ---------------------------------------------------------------------
    def plan_lookahead(self, decodes: list[Sequence], num_base_tokens: int, max_extra_tokens: int) -> dict[str, int]:
        """request_id -> draft tokens (tree: nodes) each decoding sequence verifies this step; absent = 0.

        num_base_tokens: the target pass's tokens before speculation; max_extra_tokens: room left for drafts.
        A seeded sampling request keeps its own nominal k (see adaptive.py) so its draws do not depend on
        timing; with is_adaptive off every sequence takes num_speculative_tokens (or its tree); the rest are
        chosen together, from measured costs, to maximise the step's expected tokens per second - unless the
        guard vetoes this batch's key, where speculative steps delivered less than plain ones (goodput_guard.py),
        or the key's plans drafted nothing of late and the next is not due yet (replan.py): then only those
        seeded or fixed requests draft."""
        methods = {seq.spec.method.value for seq in decodes if seq.spec is not None and seq.spec.is_active}
        if not methods:
            return {}
        num_prefill_tokens = max(0, num_base_tokens - len(decodes))  # each decode is one token of the base
        key = self._guard_key = guard_key(len(decodes), num_prefill_tokens > 0, tuple(sorted(methods)))
        may_plan = self.guard.allows(key)
        if not may_plan:
            self.stats.num_vetoed_steps += 1
        elif not self.replan.is_due(key):  # its plans came out empty of late (replan.py)
            may_plan = False
            self.stats.num_unplanned_steps += 1
        fixed: dict[str, int] = {}
        chosen: list[tuple[Sequence, Candidate]] = []
        for seq in decodes:
            spec = seq.spec
            if spec is None or not spec.is_active:
                continue
            is_fixed = self._drafts_regardless(seq)
            if not (is_fixed or may_plan):  # vetoed: the common case at large batches, kept cheap
                continue
            useful = min(seq.params.max_tokens - seq.num_output_tokens - 1, self.max_model_len - len(seq))
            if useful <= 0:  # the step's own token is the last one: nothing to draft
                continue
            is_tree_seq = self.uses_tree(spec) and not seq.drafts_chains_only  # constrained or penalized: chains
            tree_size = self.cfg.tree_size if is_tree_seq and useful >= self.cfg.tree_size else 0
            # a lookahead of tree_size or more means a tree (see _propose_with_draft): chains stay shorter
            chain_max = min(self.adaptive.k_max, useful, self.cfg.tree_size - 1 if is_tree_seq else useful)
            if is_fixed:
                nominal = self.adaptive.k_max if not self.cfg.is_adaptive else spec.controller.k
                fixed[seq.request_id] = tree_size or min(nominal, chain_max)
                continue
            proposer = spec.method.value if spec.method.value in self.proposer_costs else None
            chosen.append((seq, Candidate(
                acceptance=spec.controller.acceptance,
                max_k=chain_max,
                proposer=proposer,
                num_catch_up_tokens=self._catch_up_cost_tokens(seq, spec),
                tree_size=tree_size,
                tree_branching=self.cfg.tree_branching,
                tree_level_acceptance=spec.controller.tree_level_acceptance,
                num_context_tokens=seq.num_computed_tokens,
            )))  # fmt: skip
        # speculation is off for the decode steps of a batch this size: prompts wait to be taken in (prefill)
        decode_key = guard_key(len(decodes), False, key[2])
        self._is_intake_paused = self.replan.is_quiet(decode_key) or self.guard.is_vetoed(decode_key)
        num_fixed = sum(fixed.values())
        tally = self.chosen_by_batch.setdefault(len(decodes), [0, 0])
        tally[0] += 1
        tally[1] += num_fixed
        if not chosen:
            return fixed
        plan = choose_lengths(
            [c for _, c in chosen],
            num_sure_tokens=len(decodes),
            num_base_tokens=num_base_tokens + num_fixed,
            max_extra_tokens=max(0, max_extra_tokens - num_fixed),
            target=self.target_costs,
            proposers=self.proposer_costs,
            speculative_step_s=self.step_overhead.speculative_step_s,
            speculative_seq_s=self.step_overhead.speculative_seq_s,
            plain_step_s=(self.step_overhead.plain_per_seq_s or 0.0) * len(decodes),
            num_prefill_tokens=num_prefill_tokens,
            base_work=AttentionWork(  # each decode's row, and a fixed one's drafts, over its committed tokens
                sum(seq.num_computed_tokens for seq in decodes),
                sum((1 + fixed.get(seq.request_id, 0)) * seq.num_computed_tokens for seq in decodes),
            ),
        )
        is_empty = not any(plan.lengths)
        self.replan.record(key, is_empty)
        lengths = dict(fixed)
        tally[1] += sum(plan.lengths)
        room = max_extra_tokens - num_fixed
        if is_empty and self.replan.is_probe_due(key):  # drafts anyway, to re-measure (replan.py)
            # not the policy's plan, so the guard does not judge it (a probe pays the proposer's backlog: the
            # prompts it did not take in while the key was quiet)
            self._guard_key = None
            behind = [len(seq) - (seq.spec.draft_num_computed if seq.spec else 0) for seq, _ in chosen]
            for seq, c in (chosen[i] for i in probe_picks(behind)):  # each its tree or its longest chain
                k = c.tree_size if 0 < c.tree_size <= room else min(c.max_k, room)
                if k <= 0:
                    break
                lengths[seq.request_id] = k
                room -= k
                tally[1] += k
            return lengths
        for (seq, c), k, is_tree in zip(chosen, plan.lengths, plan.is_tree, strict=True):
            if k:
                lengths[seq.request_id] = k if is_tree else max(k, min(self.adaptive.k_min, c.max_k))
        return lengths

    def _drafts_regardless(self, seq: Sequence) -> bool:
        """Its lengths are fixed, not chosen from costs: a seeded sampling request (its draws must not depend on
        timing), or every request when is_adaptive is off."""
        return seq.params.is_seeded_sampling or not self.cfg.is_adaptive

    def _catch_up_cost_tokens(self, seq: Sequence, spec: SpecState) -> int:
        """Tokens a proposer's first pass is charged: those it has not seen, up to a step's worth (k_max + 1).
        A longer backlog (steps it sat out) is paid whenever it next drafts, so it must not weigh on this step
        alone: charged in full, it would keep a sequence from ever drafting again. A prompt the proposer never
        took in (its intake was paused, see prefill) is charged in full: that is a pass over all of it."""
        if spec.draft_num_computed == 0:
            return len(seq)
        return max(1, min(len(seq) - spec.draft_num_computed, self.adaptive.k_max + 1))

    def propose(self, speculating: list[ScheduledSeq]) -> ProposeOutput:
        """Up to num_lookahead draft tokens for each entry; reads the sequences, writes none of them."""
        out = ProposeOutput()
        by_draft: list[ScheduledSeq] = []
        by_eagle: list[ScheduledSeq] = []
        for s in speculating:
            assert s.seq.spec is not None
            if s.seq.spec.ngram is not None:
                tokens = s.seq.spec.ngram.propose(s.num_lookahead)
                if s.seq.grammar is not None:  # cut at the first token its grammar refuses
                    tokens = tokens[: s.seq.grammar.valid_prefix(tokens)]
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
                self._proposal_passes.begin()
                try:
                    self._propose_with(proposer, entries, out, reason)
                finally:
                    elapsed_s = time.perf_counter() - start_s
                    self._proposal_passes.end(elapsed_s)  # its passes priced with the work between them
                self._count_draft_time(entries[0].seq.spec.method, elapsed_s)  # type: ignore[union-attr]
        return out

    def _count_draft_time(self, method: SpeculativeMethod, elapsed_s: float) -> None:
        self.stats.draft_time_s += elapsed_s
        self.stats.by_method(method).draft_time_s += elapsed_s

    def lacks_intake(self, seq: Sequence) -> bool:
        """A decoding sequence whose prompt its proposer has not taken in (prefill paused), to take in once the
        batch's speculation is on again."""
        spec = seq.spec
        return not self._is_intake_paused and spec is not None and spec.is_active and spec.draft_num_computed == 0

    def prefill(self, prefilled: list[Sequence]) -> ProposeOutput:
        """After a step's target pass: the draft model and the head run over what its prefill chunks computed
        (DraftProposer.prefill, EagleProposer.prefill), so a prompt is never a proposal's backlog - a backlog
        the length policy could only charge a step's worth of (_catch_up_cost_tokens). Not while decode steps of
        the batch's size are vetoed or quiet (their plans draft nothing): there the intake buys nothing, and at
        16 sequences on the demo pair it cost the draft model's SD ~2.5 % of plain decoding's speed. A prompt
        not taken in is charged in full to a proposal before the intake resumes, and taken in with the next
        prefill once it does (lacks_intake). Sequences that draft whatever the costs are always taken in.
        Reads the sequences only."""
        out = ProposeOutput()
        if self._is_intake_paused:
            prefilled = [seq for seq in prefilled if self._drafts_regardless(seq)]
        for method, proposer, reason in (
            (SpeculativeMethod.DRAFT, self.draft, "draft_error"), (SpeculativeMethod.EAGLE, self.eagle, "head_error")
        ):  # fmt: skip
            if proposer is None:
                continue
            seqs = [
                seq for seq in prefilled
                if seq.spec is not None and seq.spec.is_active and seq.spec.method is method and proposer.can_prefill(seq)
            ]  # fmt: skip
            if not seqs:
                continue
            start_s = time.perf_counter()
            try:
                out.proposals.update((seq.request_id, p) for seq, p in zip(seqs, proposer.prefill(seqs), strict=True))
            except Exception:
                _fall_back(out, [seq.request_id for seq in seqs], reason)
            self._count_draft_time(method, time.perf_counter() - start_s)
        return out

    def _propose_with(
        self, proposer: DraftProposer | EagleProposer, entries: list[ScheduledSeq], out: ProposeOutput, reason: str
    ) -> None:
        """Full-size token trees where the budget allows one, chains for the rest (see lookahead)."""
        tree_size = self.cfg.tree_size
        by_shape: dict[bool, list[ScheduledSeq]] = {True: [], False: []}  # is a tree -> entries
        for s in entries:
            by_shape[bool(tree_size) and s.num_lookahead >= tree_size and not s.seq.drafts_chains_only].append(s)
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
        except Exception:
            _fall_back(out, [s.request_id for s in entries], reason)
            return
        out.proposals.update(made)

    # ---- after the forward ----------------------------------------------------------------------
    def verify(self, entries: list[VerifyEntry], logits: torch.Tensor) -> list[Verdict]:
        """logits: [S, V], each entry's 1 + num_tokens rows in order."""
        return verify_batch(entries, logits, self.row_max)


def _fall_back(out: ProposeOutput, request_ids: list[str], reason: str) -> None:
    """A broken draft or head must not lose the jobs: called from its except block, it logs the error and
    lets the sequences continue with plain decoding."""
    log.exception("%s: %d sequences fall back to plain decoding", reason, len(request_ids))
    out.fallbacks.update((request_id, reason) for request_id in request_ids)
