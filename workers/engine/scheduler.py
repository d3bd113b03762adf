"""Continuous batching: each step admits waiting sequences while KV blocks allow, mixes (chunked) prefill
with decode under a token budget, and preempts the newest running sequence (recompute) when blocks run out.
Priorities (workers/engine/priority.py): both queues are sorted by priority, the most urgent waiting sequence
may preempt less urgent running ones (bounded per sequence), and KV pressure preempts the least urgent first.
A sequence preempted for a slot only keeps its KV while it waits (parked) and resumes without recompute; KV
pressure frees parked KV before it preempts any running sequence.

A preempted sequence is recomputed from its prompt and output so far, up to but not including its last token;
that token then runs as an ordinary decode (drafting as it would have): a seeded request's draws come from its
own generator in step order, so the same steps give the same sample.

A sequence admitted without KV first claims the registered blocks of its first tokens (prefix caching,
workers/engine/prefix_cache.py): they count as computed, and its chunk and block needs are what is left.

The scheduler only moves sequences between the `waiting` and `running` deques and owns their status and
KV blocks (preemption drops a sequence's KV). Each step it hands out a plan, SchedulerOutput
(workers/engine/scheduler_output.py); the engine applies the step's results.
"""

import time
from collections import deque
from collections.abc import Callable

from workers.engine.block_manager import BlockManager
from workers.engine.priority import PriorityPolicy, insert_by_priority
from workers.engine.scheduler_output import ScheduledSeq, SchedulerOutput
from workers.engine.sequence import Sequence, SequenceStatus

# (decoding sequences, the pass's tokens before drafts, room left for drafts) -> request_id -> draft tokens
PlanLookahead = Callable[[list[Sequence], int, int], dict[str, int]]


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        plan_lookahead: PlanLookahead = lambda decodes, num_base_tokens, max_extra_tokens: {},
        policy: PriorityPolicy | None = None,  # None: no preemption for priority, no reservations
    ) -> None:
        self.block_manager = block_manager
        self.policy = policy or PriorityPolicy(max_num_seqs, block_manager.num_blocks)
        self.plan_lookahead = plan_lookahead  # draft tokens per decoding sequence, chosen for the whole step
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()

    def add(self, seq: Sequence) -> None:
        insert_by_priority(self.waiting, seq)

    def num_preemptible_for(self, priority: int) -> int:
        """How many requests of `priority` could start now by preempting less urgent ones."""
        return self.policy.num_preemptible_for(priority, self.waiting, self.running)

    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        preempted: list[Sequence] = []
        self._preempt_for_waiting(preempted)
        num_for_priority = len(preempted)
        self._resume_parked(preempted)
        lookaheads = self._plan_lookahead()
        solo_priority = self._solo_priority()
        for seq in list(self.running):
            if budget == 0 or seq.status is not SequenceStatus.RUNNING:
                break
            if solo_priority is not None and seq.priority > solo_priority:
                break  # running is sorted: everything from here on is less urgent
            num_new = _chunk_size(seq, budget)
            is_decode = num_new == seq.num_uncomputed_tokens == 1
            num_extra = min(lookaheads.get(seq.request_id, 0), budget - num_new) if is_decode else 0
            if not self._reserve(seq, seq.num_computed_tokens + num_new + num_extra, preempted):
                break  # seq itself was preempted; it was the newest, nothing runs after it
            scheduled.append(_entry(seq, num_new, num_extra))
            budget -= num_new + num_extra
        is_kv_short = len(preempted) > num_for_priority  # running sequences preempted each other: admit none
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not is_kv_short:
            seq = self.waiting[0]
            if seq in preempted:
                break  # a sequence preempted this step waits at least until the next one
            claimed, num_new, need = self._admission(seq, budget)
            if not self.block_manager.can_allocate(need) or not self.policy.may_admit(seq, self.running, need):
                break
            self._admit(seq, num_new, claimed)
            scheduled.append(_entry(seq, num_new, 0))
            budget -= num_new
        return SchedulerOutput(scheduled, self.max_num_batched_tokens - budget, preempted)

    def _admission(self, seq: Sequence, budget: int) -> tuple[list[int], int, int]:
        """What admitting `seq` now would take: (the cached blocks it claims, the tokens it computes this step,
        the blocks it takes off the free list: its chunk's, the claimed ones no table holds, plus one decode
        block of room, so that admission rarely forces preemption)."""
        manager = self.block_manager
        claimed = manager.claimable(seq)
        num_computed = seq.num_computed_tokens + len(claimed) * manager.block_size
        num_new = _chunk_size(seq, budget, num_computed)
        need = manager.blocks_for(num_computed + num_new) - len(seq.block_table) - len(claimed)
        return claimed, num_new, max(0, need) + manager.num_taken_from_free(claimed) + 1

    def _admit(self, seq: Sequence, num_new_tokens: int, claimed: list[int] | None = None) -> None:
        """Move the first waiting sequence to running, with its `claimed` cached blocks and KV for its next
        `num_new_tokens`."""
        if claimed:
            self.block_manager.claim(seq, claimed)
        elif not seq.block_table and not seq.num_computed_tokens:
            self.block_manager.count_miss(seq)
        self.block_manager.allocate(seq, seq.num_computed_tokens + num_new_tokens)
        self.waiting.remove(seq)
        seq.move_to(SequenceStatus.RUNNING)
        if seq.first_scheduled_time_s is None:
            seq.first_scheduled_time_s = time.perf_counter()
        insert_by_priority(self.running, seq)

    def _preempt_for_waiting(self, preempted: list[Sequence]) -> None:
        """Admit the most urgent waiting sequences that find no slot or no KV room by preempting less urgent
        running ones (the policy picks them, and only when that makes room); the running loop then schedules
        them first among their priority's peers. One that fits as things are is admitted here too when less
        urgent ones run (its first chunk runs without them: _solo_priority), else left to the ordinary
        admission at the end of the step."""
        manager = self.block_manager
        while self.waiting and self.waiting[0] not in preempted:
            seq = self.waiting[0]
            claimed, num_new, need = self._admission(seq, self.max_num_batched_tokens)
            num_slots_short = len(self.running) + 1 - self.max_num_seqs
            if num_slots_short <= 0 and manager.can_allocate(need):
                if not any(r.priority > seq.priority for r in self.running):
                    return  # nobody less urgent runs: the ordinary admission takes it
                self._admit(seq, num_new, claimed)  # now, so that its first chunk runs without them (schedule)
                continue
            parked = [w for w in reversed(self.waiting) if w.block_table and w.priority > seq.priority]
            num_blocks_short = need - manager.num_free_blocks - sum(len(w.block_table) for w in parked)
            victims = self.policy.victims(seq, self.running, num_blocks_short, num_slots_short)
            if victims is None or not self.policy.may_admit(seq, [r for r in self.running if r not in victims], need):
                return
            self._release_parked_kv(parked, need)
            is_kv_short = not manager.can_allocate(need)  # else only slots were short: the victims keep their KV
            for victim in victims:
                self.preempt(victim, keep_kv=not is_kv_short)
                preempted.append(victim)
            claimed, num_new, need = self._admission(seq, self.max_num_batched_tokens)  # the victims freed blocks
            if not manager.can_allocate(need - 1):  # a victim's blocks another table shares stayed: it waits on
                return
            self._admit(seq, num_new, claimed)

    def _solo_priority(self) -> int | None:
        """The priority of a request whose first prefill chunk runs this step while less urgent requests run:
        the step then runs only requests at least as urgent (the others skip one step, which changes none of
        their tokens), so an urgent request's first token costs what it costs on an idle engine. None: no such
        request."""
        fresh = [s.priority for s in self.running if s.num_computed_tokens == 0 and s.num_output_tokens == 0]
        if fresh and min(fresh) < max(s.priority for s in self.running):
            return min(fresh)
        return None

    def _resume_parked(self, preempted: list[Sequence]) -> None:
        """Parked sequences first in the waiting queue go back to running while slots allow, before the step's
        draft lengths are planned: their next step is the decode (and draft) it would have been."""
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if not seq.block_table or seq in preempted or not self.policy.may_admit(seq, self.running, 1):
                return
            self._admit(seq, 0)

    def _release_parked_kv(self, parked: list[Sequence], num_blocks: int) -> None:
        """Free the KV of waiting sequences that kept theirs (`parked`, in order) until `num_blocks` are free:
        they are recomputed on readmission."""
        for seq in parked:
            if self.block_manager.can_allocate(num_blocks):
                return
            self.block_manager.free(seq)
            seq.drop_kv()

    def _plan_lookahead(self) -> dict[str, int]:
        """Ask for the step's draft lengths, with the pass it will run: the running sequences' chunks and
        decodes, plus the prompt tokens the waiting queue is likely to add (KV permitting)."""
        budget = self.max_num_batched_tokens
        decodes = [s for s in self.running if s.num_uncomputed_tokens == 1]
        num_base = min(budget, sum(s.num_uncomputed_tokens for s in self.running))
        num_admissible = max(0, self.max_num_seqs - len(self.running))
        num_base += min(budget - num_base, sum(s.num_uncomputed_tokens for s in list(self.waiting)[:num_admissible]))
        if not decodes:
            return {}
        return self.plan_lookahead(decodes, num_base, budget - num_base)

    def _reserve(self, seq: Sequence, num_tokens: int, preempted: list[Sequence]) -> bool:
        """Give `seq` KV room for `num_tokens`, preempting the newest of the least urgent running sequences if
        needed (seq itself when it is that one)."""
        manager = self.block_manager
        if not manager.can_allocate(manager.num_missing_blocks(seq, num_tokens)):  # parked KV goes first
            parked = [w for w in reversed(self.waiting) if w.block_table]
            self._release_parked_kv(parked, manager.num_missing_blocks(seq, num_tokens))
        while not manager.can_allocate(manager.num_missing_blocks(seq, num_tokens)):
            victim = self.running[-1]
            self.preempt(victim)
            preempted.append(victim)
            if victim is seq:
                return False
        manager.allocate(seq, num_tokens)
        return True

    def preempt(self, seq: Sequence, keep_kv: bool = False) -> None:
        """Put the sequence back first among its priority's waiting sequences. Its KV is freed (it is recomputed
        on readmission) unless `keep_kv`: preempted for a slot only, it is parked with its KV and resumes where
        it stopped, unless KV runs short meanwhile (then parked KV is the first to go)."""
        self.running.remove(seq)
        if not keep_kv:
            self.block_manager.free(seq)
            seq.drop_kv()
        seq.num_preemptions += 1
        seq.move_to(SequenceStatus.WAITING)
        insert_by_priority(self.waiting, seq, first_of_its_priority=True)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Retire a sequence (finished or aborted) and return its blocks."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.finish_reason = reason
        seq.move_to(SequenceStatus.FINISHED)


def _chunk_size(seq: Sequence, budget: int, num_computed: int | None = None) -> int:
    """Committed tokens to compute this step: what is uncomputed (past `num_computed`, by default its computed
    tokens), within the budget, except that a sequence with output that lost its KV (preemption) stops short of
    its last token, which then runs as a decode."""
    num_tokens = len(seq) - (seq.num_computed_tokens if num_computed is None else num_computed)
    if num_tokens > 1 and seq.num_output_tokens > 0:
        num_tokens -= 1
    return min(num_tokens, budget)


def _entry(seq: Sequence, num_new_tokens: int, num_lookahead: int) -> ScheduledSeq:
    start_pos = seq.num_computed_tokens
    return ScheduledSeq(
        seq=seq,
        start_pos=start_pos,
        num_new_tokens=num_new_tokens,
        num_lookahead=num_lookahead,
        is_sampling=start_pos + num_new_tokens == len(seq),
        block_table=seq.block_table,
    )
