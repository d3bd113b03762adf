"""Applying a step's results to its sequences: the one writer of Sequence and SpecState during a step.

The scheduler hands out a plan (SchedulerOutput), proposers return a ProposeOutput, the verifier returns
Verdicts; none of them writes to a sequence. The engine applies them here, in the step's order:
- after proposing: each draft proposal's draft-cache length, and the fallbacks of a failed draft;
- after verifying, per scheduled sequence: a prefill chunk short of the prompt's end advances its KV
  counter; a sampling sequence advances it by its chunk plus the accepted draft tokens, appends the
  verdict's tokens up to a stop, EOS or the length limit, and rolls speculation forward (n-gram index,
  draft cache trimmed to what was kept, accepted tree K/V moved into place, acceptance counted, k adapted);
  an EAGLE sequence also keeps the target's features of its newly committed tokens for its head.
Sequence status and KV blocks stay the scheduler's and the block manager's.
"""

import torch

from shared.speculation import SpeculativeMethod
from workers.engine.model_runner import ModelRunner
from workers.engine.scheduler_output import ScheduledSeq
from workers.engine.sequence import Sequence
from workers.engine.speculator import ProposeOutput
from workers.spec.proposal import Proposal, Verdict
from workers.spec.state import SpecStats


class StepApplier:
    def __init__(
        self,
        target: ModelRunner,  # its KV cache receives the accepted tree nodes' K/V
        stats: SpecStats,  # engine-wide speculation figures (the speculator's)
        is_adaptive: bool,  # speculation length follows acceptance (EngineConfig.is_adaptive)
        eos_token_ids: frozenset[int],
        max_model_len: int,
        store_block_size: int = 0,  # with a FeatureStore (feature_store.py): its blocks' size; 0: none
    ) -> None:
        self.target = target
        self.stats = stats
        self.is_adaptive = is_adaptive
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.store_block_size = store_block_size

    # ---- after proposing ----------------------------------------------------------------------------
    def apply_proposals(self, proposed: ProposeOutput, sequences: dict[str, Sequence]) -> None:
        for request_id, proposal in proposed.proposals.items():
            seq = sequences[request_id]
            spec = seq.spec
            if spec is not None and proposal.draft_num_computed is not None:
                spec.draft_num_computed = proposal.draft_num_computed
                if spec.method is SpeculativeMethod.EAGLE:  # the head's cache holds those rows now
                    # with a FeatureStore, the features of a block not registered yet stay for its registration
                    is_stored = self.store_block_size > 0
                    registered = seq.num_registered_blocks * self.store_block_size if is_stored else spec.draft_num_computed
                    spec.drop_features_before(min(spec.draft_num_computed, registered))
        for request_id, reason in proposed.fallbacks.items():
            self._fall_back(sequences[request_id], reason)

    # ---- after verifying ----------------------------------------------------------------------------
    def apply_chunk(
        self, s: ScheduledSeq, features: torch.Tensor | None = None, first_row: int = 0, num_rows: int | None = None
    ) -> None:
        """A prefill chunk short of the prompt's end: its K/V are in the cache now (features: the pass's [T, hidden];
        rows first_row .. first_row + num_rows - 1 are the target's feature of each of its tokens, for an EAGLE
        sequence; num_rows None: to the end)."""
        s.seq.num_computed_tokens += s.num_new_tokens
        if features is not None and s.seq.spec is not None and s.seq.spec.wants_features:
            s.seq.spec.keep_features(s.start_pos, features, first_row, num_rows)

    def apply_verdict(
        self,
        s: ScheduledSeq,
        proposal: Proposal | None,
        verdict: Verdict,
        now_s: float,
        features: torch.Tensor | None = None,  # the pass's [T, hidden]: every query row's feature (EAGLE)
        first_row: int = 0,  # the sequence's rows there: first_row .. first_row + n + proposal size - 1
    ) -> tuple[list[int], str | None]:  # (tokens appended, finish reason or None)
        seq = s.seq
        old_len = len(seq)
        if features is not None and seq.spec is not None and seq.spec.wants_features:
            self._keep_committed_features(s, proposal, verdict, features, first_row)
        seq.num_computed_tokens += s.num_new_tokens + verdict.num_accepted
        seq.first_token_time_s = seq.first_token_time_s or now_s
        appended: list[int] = []
        reason = None
        for token in verdict.tokens:
            appended.append(token)
            reason = self._append_token(seq, token)
            if reason is not None:
                break  # nothing past a stop, EOS or the length limit is emitted
        self._roll_speculation_forward(seq, proposal, verdict, old_len, appended)
        return appended, reason

    @staticmethod
    def _keep_committed_features(
        s: ScheduledSeq, proposal: Proposal | None, verdict: Verdict, features: torch.Tensor, first_row: int
    ) -> None:
        """The chunk's rows and the accepted draft tokens' rows: committed positions start_pos onwards (the
        recovered/bonus token has no feature until the next pass computes it)."""
        assert s.seq.spec is not None
        num_chunk = s.num_new_tokens
        if proposal is not None and proposal.tree is not None:
            rows = [first_row + r for r in (*range(num_chunk), *(num_chunk + n for n in verdict.accepted_nodes or []))]
            rows_t = torch.tensor(rows, dtype=torch.long, device=features.device)  # features stay on the model's device
            s.seq.spec.keep_features(s.start_pos, features.index_select(0, rows_t))  # [n + accepted, hidden]
        else:  # rows of the pass's own output, referred to until the head reads them
            s.seq.spec.keep_features(s.start_pos, features, first_row, num_chunk + verdict.num_accepted)

    def _append_token(self, seq: Sequence, token: int) -> str | None:
        """Append one token; returns the finish reason if the sequence is done."""
        seq.token_ids.append(token)
        params = seq.params
        if token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_token_ids):
            return "stop"
        is_complete = seq.grammar is not None and seq.grammar.advance(token)  # structured output: it is whole
        is_short = seq.num_output_so_far <= params.min_tokens  # min_tokens: no stop string ends in this token's text
        if seq.detokenizer.push(token, check_stop=not is_short) or is_complete:
            return "stop"
        if seq.num_output_tokens >= params.max_tokens or len(seq) >= self.max_model_len:
            return "length"
        return None

    def _roll_speculation_forward(
        self, seq: Sequence, proposal: Proposal | None, verdict: Verdict, old_len: int, appended: list[int]
    ) -> None:
        """After `appended` (the verdict's tokens, cut at a stop) joined seq."""
        spec = seq.spec
        if spec is None:
            return
        if spec.ngram is not None:
            spec.ngram.extend(appended)
        if proposal is None:
            if self.is_adaptive and spec.is_active:  # a step without drafts: the estimate drifts back to the prior
                spec.controller.idle()
            return
        if verdict.accepted_nodes:
            self._move_tree_kv(seq, old_len, verdict.accepted_nodes)
        if proposal.tree is None and spec.method is SpeculativeMethod.DRAFT:
            spec.draft_num_computed = min(spec.draft_num_computed, old_len + verdict.num_accepted)
        else:
            spec.draft_num_computed = min(spec.draft_num_computed, old_len)
        is_rejected = verdict.rejected_a_draft(proposal)
        spec.counts.record(proposal.num_tokens, verdict.num_accepted, proposal.depth, is_rejected)
        self.stats.record(proposal.num_tokens, verdict.num_accepted, proposal.depth, spec.method, is_rejected)
        if self.is_adaptive and proposal.tree is not None:
            spec.controller.update_tree(proposal.depth, verdict.num_accepted)
        elif self.is_adaptive and spec.controller.update(proposal.num_tokens, verdict.num_accepted):
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
