"""A key's batch quota, read from its batches' hashes (README "Batches: the per-key quota").

- In flight: lines of the key's batches that are jobs now (queued or running): `expanded - completed - failed`
  summed over its unfinished batches. The expansion task submits a batch's next lines only while the key is
  under `batch_max_inflight_lines_per_key`, and more as its lines finish, so the batch queue holds at most
  that many of one key's lines: two keys' batches submitted one after the other progress together
  (round-robin by finishing lines), and one key's 50,000-line batch no longer holds the batch queue for hours.
- Pending: lines of the key's unfinished batches not finished yet, submitted or not; a new batch that would
  take the key past `batch_max_pending_lines_per_key` is refused (429).

The gateway (async) and the expansion task (sync) read the same fields of the key's newest batches (at most
MAX_BATCHES_COUNTED, from keys.batches_of) and count them here. The count is read, then acted on: two
batches of one key created at the same instant may both pass the pending check.
"""

from collections.abc import Iterable
from dataclasses import dataclass

from shared.batch_state import BatchStatus

FIELDS = ("status", "total", "expanded", "completed", "failed")  # HMGET of each batch hash, in this order
MAX_BATCHES_COUNTED = 1000  # a key's newest batches that are counted (older ones have long finished)


@dataclass(frozen=True)
class KeyLines:
    num_in_flight: int  # lines that are jobs, not finished (queued or running)
    num_pending: int  # lines not finished, jobs or not yet


def count_lines(rows: Iterable[list[str | None]]) -> KeyLines:
    """The key's lines from HMGET(batch hash, *FIELDS) of each of its batches (expired ones: all None)."""
    num_in_flight = num_pending = 0
    for status, total, expanded, completed, failed in rows:
        if status is None or BatchStatus(status).is_terminal:
            continue
        num_done = int(completed or 0) + int(failed or 0)
        num_in_flight += max(0, int(expanded or 0) - num_done)
        num_pending += max(0, int(total or 0) - num_done)
    return KeyLines(num_in_flight, num_pending)
