"""The scheduler's per-step plan, handed to the runner and the speculator (vLLM v1's `SchedulerOutput`).

The scheduler has already reserved every entry's KV blocks when it hands the plan out. The plan says what
each sequence computes this step; the speculator fills the reserved lookahead with draft tokens, the engine
builds the runner's inputs from it, and the engine alone applies the step's results to the sequences.
"""

from dataclasses import dataclass, field

from workers.engine.sequence import Sequence


@dataclass(frozen=True, slots=True)
class ScheduledSeq:
    """One sequence's share of the step."""

    seq: Sequence  # read by the runner and the speculator; the step's results are applied by workers/engine/apply.py
    start_pos: int  # first position computed: the sequence's num_computed_tokens when scheduled
    num_new_tokens: int  # committed tokens computed: seq.token_ids[start_pos : start_pos + num_new_tokens]
    num_lookahead: int  # KV slots (and token budget) reserved after them for draft tokens (tree: nodes); 0 = none
    is_sampling: bool  # the chunk reaches the sequence's last token, so the step samples its next token
    block_table: list[int]  # [num_blocks] KV block ids, covering start_pos + num_new_tokens + num_lookahead

    @property
    def request_id(self) -> str:
        return self.seq.request_id


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledSeq]  # [num_seqs] in running order; chunked prefills and decodes mixed
    num_batched_tokens: int  # committed + lookahead tokens of the step (<= max_num_batched_tokens)
    preempted: list[Sequence] = field(default_factory=list)  # sent back to waiting this step, their KV freed

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @property
    def speculating(self) -> list[ScheduledSeq]:
        """Entries with lookahead: the speculator proposes up to num_lookahead draft tokens for each."""
        return [s for s in self.scheduled if s.num_lookahead > 0]
