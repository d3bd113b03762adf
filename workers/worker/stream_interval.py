"""Fewer, larger token events: the same tokens, in fewer writes.

Every token event costs the fleet's I/O side the same fixed work whatever it carries: its share of the STEP
call, an XADD and a PUBLISH in Redis, a pub/sub message and a socket write in the gateway, a parse in the
client. Two ways to send fewer:

`TokenHold` (the loop): a job with a stream interval (`stream_interval_ms` of its request, else the worker's
`settings.stream_interval_ms` for its priority; 0 = every step) keeps the tokens of the steps in between here
and writes them as one event:
- its first write of an attempt goes at once (time to first token is not traded);
- its end (success or failure) goes at once, with whatever it held before it, in order;
- otherwise its tokens wait until its interval passed since its last token write; a job that stops producing
  (preempted) is written out at the first step after that.
Tokens held here are not in Redis: a crash loses them as it loses a step not yet written (the job resumes
from the last token written, shared/lua.py). A job dropped (cancelled, taken over) loses them with it; a
worker that stops writes them out first (`flush`). The vLLM and SGLang servers' `stream_interval` does this in
token counts; here it is time, which means the same to a reader at any step speed.

`coalesce` (the writer process): the steps it takes in one batch (they came while it wrote the last one) are
written with each job's tokens as one event. That delays nothing, so it applies to every job.
"""

import math
from dataclasses import replace

from workers.worker.emitter import JobWrite


def merge(parts: list[JobWrite]) -> JobWrite:
    """One write of `parts`' tokens, in order (one job and attempt, each continuing the one before; the last one's
    end, if it has one, is the write's)."""
    if len(parts) == 1:
        return parts[0]
    later = parts[-1]
    logprobs = None
    if all(part.new_logprobs is not None for part in parts):
        logprobs = tuple(lp for part in parts for lp in part.new_logprobs or ())
    prompt_logprobs = next((part.prompt_logprobs for part in parts if part.prompt_logprobs is not None), None)
    return replace(
        later,
        new_text="".join(part.new_text for part in parts),
        new_token_ids=tuple(token_id for part in parts for token_id in part.new_token_ids),
        new_logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
    )


def coalesce(writes: list[JobWrite]) -> list[JobWrite]:
    """Several steps' writes, in step order -> the same tokens in fewer writes: each job's token-only writes join
    its next write that continues them (same attempt, its tokens right after theirs): its end, or its last
    token-only one. A failure stays apart, after the tokens before it; a write that does not continue them (a
    replay) is not merged, so the STEP script still skips it. The writer process applies this to the steps it
    takes at once (they came while it wrote the last batch), so a busy writer sends fewer, larger events and
    delays none. Per job the order is kept; across jobs it is not needed (each has its own stream)."""
    held: dict[str, list[JobWrite]] = {}  # job id -> its token-only writes not placed yet
    out: list[JobWrite] = []
    for write in writes:
        pending = held.pop(write.job_id, [])
        if pending and (write.failure is not None or not _continues(pending[-1], write)):
            out.append(merge(pending))
            pending = []
        if write.new_token_ids and not write.is_finished and write.failure is None:
            held[write.job_id] = [*pending, write]
        else:
            out.append(merge([*pending, write]))
    out += [merge(pending) for pending in held.values()]
    return out


def _continues(earlier: JobWrite, later: JobWrite) -> bool:
    """`later`'s tokens start where `earlier`'s end, in the same attempt."""
    return later.attempt == earlier.attempt and later.completion_tokens - len(later.new_token_ids) == (
        earlier.completion_tokens
    )


class TokenHold:
    """job id -> its tokens not written yet, for the jobs that have a stream interval."""

    def __init__(self) -> None:
        self.interval_s: dict[str, float] = {}  # job id -> its stream interval (jobs with one > 0 only)
        self.held: dict[str, list[JobWrite]] = {}  # job id -> its token-only writes since its last write, in order
        self._last_write_s: dict[str, float] = {}  # job id -> monotonic time of its last token write
        self._due_s = math.inf  # the earliest time a held write is due

    def track(self, job_id: str, interval_s: float) -> None:
        """A job started (each attempt): hold its tokens for `interval_s` (<= 0: never)."""
        self.forget([job_id])
        if interval_s > 0:
            self.interval_s[job_id] = interval_s

    def take(self, writes: list[JobWrite], now_s: float, now_for: frozenset[str] = frozenset()) -> list[JobWrite]:
        """One step's writes -> what to write now, in order: token-only writes inside their job's interval stay
        here (appended: a step costs a held job a list append), the job's next write that goes takes them along
        (merged then, once), held writes past their interval come out at the end. `now_for`: jobs whose writes
        go now whatever their interval (a webhook `output` notice about to read their output)."""
        if not self.interval_s:
            return writes
        out = []
        for write in writes:
            job_id = write.job_id
            interval_s = self.interval_s.get(job_id)
            if interval_s is None:  # a job without an interval: its write as it is
                out.append(write)
                continue
            held = self.held.get(job_id)
            last_s = self._last_write_s.get(job_id)
            is_tokens_only = write.new_token_ids and not write.is_finished and write.failure is None
            if is_tokens_only and last_s is not None and now_s - last_s < interval_s and job_id not in now_for:
                if held is None:
                    self.held[job_id] = [write]
                    self._due_s = min(self._due_s, last_s + interval_s)
                else:
                    held.append(write)
                continue
            if held is not None:  # they go with it (a failure: after them, apart)
                del self.held[job_id]
                out += coalesce([*held, write])
                self._last_write_s[job_id] = now_s
                continue
            if write.new_token_ids:
                self._last_write_s[job_id] = now_s
            out.append(write)
        if now_s >= self._due_s:
            out += self._take_due(now_s)
        return out

    def _take_due(self, now_s: float) -> list[JobWrite]:
        due = []
        self._due_s = math.inf
        for job_id in list(self.held):
            due_s = self._last_write_s[job_id] + self.interval_s[job_id]
            if due_s <= now_s:
                due.append(merge(self.held.pop(job_id)))
                self._last_write_s[job_id] = now_s
            else:
                self._due_s = min(self._due_s, due_s)
        return due

    def flush(self) -> list[JobWrite]:
        """Everything held, to write now (the worker stops)."""
        writes = [merge(held) for held in self.held.values()]
        self.held.clear()
        self._due_s = math.inf
        return writes

    def forget(self, job_ids: list[str]) -> None:
        """Jobs that ended or are no longer this worker's: what they held is dropped."""
        for job_id in job_ids:
            self.interval_s.pop(job_id, None)
            self.held.pop(job_id, None)
            self._last_write_s.pop(job_id, None)
