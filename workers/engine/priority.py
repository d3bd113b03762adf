"""Priority scheduling, bounded (vLLM v1's `priority` policy is the anchor): a lower `priority` value is more
urgent. The worker maps its queues to values (interactive 0, default 1, batch 2); a request that names none
gets 0.

- Order: the scheduler keeps its waiting and running queues sorted by priority, first come first served within
  one, so it admits the most urgent waiting sequence first, and KV pressure among running sequences preempts
  from the running queue's tail: the least urgent, newest sequence (as before, when all were equal).
- Preemption for a waiting sequence: when the most urgent waiting sequence finds no free slot or no KV room,
  running sequences of strictly lower priority are preempted (least urgent, newest first), and only when that
  makes room; never one of equal or higher priority, and never one already preempted `preemption_limit`
  times, so batch work still finishes. A preempted sequence is recomputed from its prompt and output so far.
- Reservations: `reserved_fraction[p]` of the slots and of the KV blocks is kept for sequences of priority
  <= p. A less urgent sequence still uses that capacity while nobody more urgent wants it (it borrows it and
  can be preempted when they do); a sequence at its preemption limit, which nothing may preempt any more, is
  admitted only into capacity not reserved for more urgent priorities, so a reserve can always be taken back.
"""

from collections import deque
from collections.abc import Iterable

from workers.engine.sequence import Sequence


class PriorityPolicy:
    def __init__(
        self,
        max_num_seqs: int,
        num_blocks: int,
        preemption_limit: int = 0,  # preemptions for more urgent sequences, at most, per sequence; 0 = none
        reserved_fraction: dict[int, float]
        | None = None,  # priority -> share of slots and blocks kept for <= it
    ) -> None:
        self.max_num_seqs = max_num_seqs
        self.num_blocks = num_blocks
        self.preemption_limit = preemption_limit
        self.reserved_fraction = dict(reserved_fraction or {})

    def is_preemptible(self, seq: Sequence) -> bool:
        """May `seq` still be preempted for a more urgent sequence?"""
        return seq.num_preemptions < self.preemption_limit

    def share_of(self, priority: int) -> tuple[int, int]:
        """(slots, KV blocks) not reserved for priorities more urgent than `priority`."""
        reserved = min(1.0, sum(f for p, f in self.reserved_fraction.items() if p < priority))
        return int(self.max_num_seqs * (1 - reserved) + 1e-9), int(self.num_blocks * (1 - reserved) + 1e-9)

    def may_admit(self, seq: Sequence, running: Iterable[Sequence], num_new_blocks: int) -> bool:
        """Admission within reservations: a preemptible sequence may borrow reserved capacity; one at its
        limit must fit, with every running sequence of its priority or less urgent, in its own share."""
        if self.is_preemptible(seq) or not self.reserved_fraction:
            return True
        max_seqs, max_blocks = self.share_of(seq.priority)
        peers = [r for r in running if r.priority >= seq.priority]
        num_blocks = sum(len(r.block_table) for r in peers) + num_new_blocks
        return len(peers) + 1 <= max_seqs and num_blocks <= max_blocks

    def victims(
        self, seq: Sequence, running: deque[Sequence], num_blocks_short: int, num_slots_short: int
    ) -> list[Sequence] | None:
        """The running sequences to preempt so that `seq` fits (least urgent, newest first), or None when
        preempting every eligible one would not make room."""
        victims: list[Sequence] = []
        num_freed = 0
        for other in reversed(running):  # sorted by priority: the least urgent, newest first
            if num_freed >= num_blocks_short and len(victims) >= num_slots_short:
                break
            if other.priority <= seq.priority:
                break  # everything before it is at least as urgent as seq
            if self.is_preemptible(other):
                victims.append(other)
                num_freed += len(other.block_table)
        if num_freed >= num_blocks_short and len(victims) >= num_slots_short:
            return victims
        return None

    def num_preemptible_for(
        self, priority: int, waiting: Iterable[Sequence], running: Iterable[Sequence]
    ) -> int:
        """How many sequences of `priority` could start now by preempting less urgent ones (slots only; KV
        is checked when they are scheduled): none while one at least as urgent already waits."""
        if any(w.priority <= priority for w in waiting):
            return 0
        return sum(1 for r in running if r.priority > priority and self.is_preemptible(r))


def insert_by_priority(queue: deque[Sequence], seq: Sequence, *, first_of_its_priority: bool = False) -> None:
    """Put `seq` after every sequence more urgent than it and, unless `first_of_its_priority`, after those of
    its own priority too (FCFS within a priority; a preempted sequence goes back first among its peers)."""
    if not first_of_its_priority and (not queue or queue[-1].priority <= seq.priority):
        queue.append(seq)  # the common case, O(1): every request of one priority
        return
    for index, other in enumerate(queue):
        if other.priority > seq.priority or (first_of_its_priority and other.priority == seq.priority):
            queue.insert(index, seq)
            return
    queue.append(seq)
