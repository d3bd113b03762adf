"""A job's tokens held between its writes (workers/worker/stream_interval.py): its first write and its end go at
once, the tokens between come out merged once its interval passed, in order, with nothing dropped or doubled;
a job without an interval passes straight through. Times are given, not slept."""

import dataclasses

from shared.job_state import ErrorCode
from shared.logprobs import TokenLogprob
from workers.worker.emitter import JobFailure, JobWrite
from workers.worker.stream_interval import TokenHold, coalesce


def tokens(job_id: str, ids: list[int], completion_tokens: int, *, logprobs: bool = False) -> JobWrite:
    """One step's token-only write of `ids` (text: the ids joined by '.')."""
    lps = tuple(TokenLogprob(token=str(i), token_id=i, logprob=-1.0) for i in ids) if logprobs else None
    return JobWrite(job_id=job_id, attempt=1, prompt_tokens=3, completion_tokens=completion_tokens,
                    new_text="".join(f"{i}." for i in ids), new_token_ids=tuple(ids), new_logprobs=lps)  # fmt: skip


def finish(job_id: str, ids: list[int], completion_tokens: int) -> JobWrite:
    return JobWrite(job_id=job_id, attempt=1, prompt_tokens=3, completion_tokens=completion_tokens,
                    new_text="".join(f"{i}." for i in ids), new_token_ids=tuple(ids), finish_reason="length",
                    is_finished=True, metrics={"compute_s": 0.5})  # fmt: skip


def test_a_job_without_an_interval_passes_through() -> None:
    hold = TokenHold()
    hold.track("a", 0.0)
    writes = [tokens("a", [1], 1)]
    assert hold.take(writes, 0.0) is writes  # nothing tracked: the list itself, no work
    assert hold.take([tokens("a", [2], 2)], 0.001) == [tokens("a", [2], 2)]
    assert not hold.held


def test_first_write_at_once_then_one_merged_write_per_interval() -> None:
    hold = TokenHold()
    hold.track("a", 0.010)
    assert hold.take([tokens("a", [1], 1)], 0.000) == [tokens("a", [1], 1)]  # the first token: at once
    assert hold.take([tokens("a", [2], 2)], 0.004) == []
    assert hold.take([tokens("a", [3, 4], 4)], 0.008) == []
    out = hold.take([tokens("a", [5], 5)], 0.011)  # 11 ms since the last write
    assert out == [JobWrite(job_id="a", attempt=1, prompt_tokens=3, completion_tokens=5, new_text="2.3.4.5.",
                            new_token_ids=(2, 3, 4, 5))]  # fmt: skip
    assert hold.take([tokens("a", [6], 6)], 0.015) == []  # the interval counts from that write
    assert hold.take([tokens("a", [7], 7)], 0.021)[0].new_token_ids == (6, 7)


def test_the_end_goes_at_once_with_what_was_held() -> None:
    hold = TokenHold()
    hold.track("a", 1.0)
    hold.take([tokens("a", [1], 1)], 0.0)
    assert hold.take([tokens("a", [2], 2, logprobs=True)], 0.1) == []
    assert hold.take([tokens("a", [3], 3, logprobs=True)], 0.2) == []
    [done] = hold.take([finish("a", [4], 4)], 0.3)
    assert done.is_finished and done.finish_reason == "length" and done.metrics == {"compute_s": 0.5}
    assert done.new_token_ids == (2, 3, 4) and done.new_text == "2.3.4." and done.completion_tokens == 4
    assert done.new_logprobs is None  # the finishing write had none: logprobs are all or nothing per job
    assert not hold.held


def test_logprobs_are_merged_in_order() -> None:
    hold = TokenHold()
    hold.track("a", 1.0)
    hold.take([tokens("a", [1], 1, logprobs=True)], 0.0)
    hold.take([tokens("a", [2, 3], 3, logprobs=True)], 0.1)
    [out] = hold.take([tokens("a", [4], 4, logprobs=True)], 1.5)
    assert out.new_logprobs is not None and [lp.token_id for lp in out.new_logprobs] == [2, 3, 4]


def test_a_failure_lands_after_the_held_tokens() -> None:
    hold = TokenHold()
    hold.track("a", 1.0)
    hold.take([tokens("a", [1], 1)], 0.0)
    hold.take([tokens("a", [2], 2)], 0.1)
    failure = JobWrite(job_id="a", attempt=1, prompt_tokens=0, completion_tokens=0,
                       failure=JobFailure(ErrorCode.TIMEOUT, "past its deadline"))  # fmt: skip
    assert hold.take([failure], 0.2) == [tokens("a", [2], 2), failure]


def test_a_job_that_stops_producing_is_written_out_when_due() -> None:
    hold = TokenHold()
    hold.track("a", 0.010)
    hold.track("b", 0.050)
    hold.take([tokens("a", [1], 1), tokens("b", [7], 1)], 0.000)
    hold.take([tokens("a", [2], 2), tokens("b", [8], 2)], 0.002)
    assert hold.take([], 0.009) == []
    assert hold.take([], 0.010) == [tokens("a", [2], 2)]  # b's interval has not passed
    assert hold.take([], 0.049) == []
    assert hold.take([], 0.051) == [tokens("b", [8], 2)]
    assert not hold.held


def test_jobs_with_and_without_an_interval_side_by_side_keep_their_order() -> None:
    hold = TokenHold()
    hold.track("slow", 1.0)
    hold.track("fast", 0.0)
    hold.take([tokens("slow", [1], 1), tokens("fast", [1], 1)], 0.0)
    assert hold.take([tokens("slow", [2], 2), tokens("fast", [2], 2)], 0.1) == [tokens("fast", [2], 2)]
    out = hold.take([tokens("fast", [3], 3), finish("slow", [3], 3)], 0.2)
    assert [(w.job_id, w.new_token_ids) for w in out] == [("fast", (3,)), ("slow", (2, 3))]


def test_forget_drops_and_flush_takes_everything_held() -> None:
    hold = TokenHold()
    for job_id in ("a", "b"):
        hold.track(job_id, 1.0)
        hold.take([tokens(job_id, [1], 1)], 0.0)
        hold.take([tokens(job_id, [2], 2)], 0.1)
    hold.forget(["a"])  # cancelled: its held tokens go with it
    assert hold.flush() == [tokens("b", [2], 2)]
    assert hold.take([tokens("b", [3], 3)], 0.2) == []  # still tracked after a flush
    hold.track("b", 1.0)  # a new attempt: its first write goes at once again
    assert hold.take([tokens("b", [3], 3)], 0.3) == [tokens("b", [3], 3)]


def test_coalesce_puts_a_jobs_steps_into_one_write_each_and_keeps_its_order() -> None:
    failure = JobWrite(job_id="c", attempt=1, prompt_tokens=0, completion_tokens=0,
                       failure=JobFailure(ErrorCode.TIMEOUT, "past its deadline"))  # fmt: skip
    retried = dataclasses.replace(tokens("d", [9], 1), attempt=2)
    writes = [tokens("a", [1], 1, logprobs=True), tokens("b", [5], 1), tokens("c", [7], 1), tokens("d", [8], 1),
              tokens("a", [2], 2, logprobs=True), finish("b", [6], 2), failure, retried,
              tokens("a", [3], 3, logprobs=True)]  # fmt: skip
    out = coalesce(writes)
    by_job: dict[str, list[JobWrite]] = {}
    for write in out:
        by_job.setdefault(write.job_id, []).append(write)
    [a] = by_job["a"]
    assert a.new_token_ids == (1, 2, 3) and a.new_text == "1.2.3." and a.completion_tokens == 3
    assert a.new_logprobs is not None and [lp.token_id for lp in a.new_logprobs] == [1, 2, 3]
    [b] = by_job["b"]
    assert b.is_finished and b.new_token_ids == (5, 6) and b.completion_tokens == 2
    assert by_job["c"] == [tokens("c", [7], 1), failure]  # the failure after the tokens it followed
    assert by_job["d"] == [tokens("d", [8], 1), retried]  # another attempt's writes are not merged
    assert coalesce([tokens("a", [1], 1)]) == [tokens("a", [1], 1)]
    replayed = [tokens("e", [1], 1), tokens("e", [1], 1)]  # the same write twice: the STEP script skips the second
    assert coalesce(replayed) == replayed


def test_a_job_named_now_writes_what_it_held_at_once() -> None:
    hold = TokenHold()
    hold.track("a", 1.0)
    hold.take([tokens("a", [1], 1)], 0.0)
    assert hold.take([tokens("a", [2], 2)], 0.1) == []
    [out] = hold.take([tokens("a", [3], 3)], 0.2, now_for=frozenset({"a"}))  # its webhook `output` notice is due
    assert out.new_token_ids == (2, 3) and not hold.held
