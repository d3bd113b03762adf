"""The emitter: one command (the STEP script) per step, events and partial output in step, a job finishes exactly once."""

import json

import redis

from shared import keys
from shared.settings import ServiceSettings
from tests.helpers.played_worker import step_output
from tests.helpers.redis_fixtures import job_record, submit_job
from workers.worker.emitter import Emitter, Running
from workers.worker.queue_reader import QueueReader


def _start(
    rclient: redis.Redis, settings: ServiceSettings, num_jobs: int
) -> tuple[list[str], dict[str, Running]]:
    jobs = [submit_job(rclient, settings) for _ in range(num_jobs)]
    reader = QueueReader(rclient, settings, "w1")
    reader.ensure_groups()
    leases = reader.pull(num_jobs)
    return jobs, {lease.job_id: Running(lease.job_id, lease.attempt, prompt_tokens=4) for lease in leases}


def command_calls(client: redis.Redis) -> dict[str, int]:
    """Commands Redis has run so far, by name (INFO commandstats), the INFO calls themselves left out."""
    stats = client.info("commandstats")
    return {name: stat["calls"] for name, stat in stats.items() if name != "cmdstat_info"}


def test_one_step_of_many_jobs_is_one_command(rclient: redis.Redis, settings: ServiceSettings) -> None:
    jobs, running = _start(rclient, settings, 3)
    emitter = Emitter(rclient, settings)
    emitter.load_script()
    before = command_calls(rclient)
    assert emitter.emit(running, []) == ([], [])
    assert command_calls(rclient) == before  # nothing to write: no round trip at all
    emitter.emit(running, [step_output(job_id, [1, 2], "ab") for job_id in jobs])
    after = command_calls(rclient)
    ran = {name: after[name] - before.get(name, 0) for name in after if after[name] != before.get(name, 0)}
    assert ran.pop("cmdstat_evalsha") == 1  # ONE script call carries the three jobs' tokens ...
    # (its inside; xrevrange: the id the wake-up quotes; append: the new tokens, strlen: whether a comma leads)
    inside = ("hmget", "hset", "hincrby", "xrevrange", "xadd", "publish", "append", "strlen")
    assert set(ran) <= {f"cmdstat_{c}" for c in inside}
    for job_id in jobs:
        job = job_record(rclient, job_id)
        assert (job["text"], job["token_ids"], job["completion_tokens"]) == ("ab", "1,2", "2")
        token_event = rclient.xrevrange(keys.job_events(job_id), count=1)[0][1]
        assert token_event["type"] == "token" and json.loads(token_event["data"]) == {
            "text": "ab",
            "token_ids": [1, 2],
        }


def test_a_step_writes_its_new_tokens_and_the_end_folds_them_in(
    rclient: redis.Redis, settings: ServiceSettings
) -> None:
    """A running job's steps APPEND their tokens to the output strings: no step reads or rewrites the output so
    far (its cost and its AOF entry stay the size of one step, however long the job). Its end moves the whole
    output into the hash, once, and the strings go; a retried job's next attempt appends after it."""
    (job_id,), running = _start(rclient, settings, 1)
    emitter = Emitter(rclient, settings)
    for i in range(50):
        emitter.emit(running, [step_output(job_id, [i], f"<{i}>")])
    text = "".join(f"<{i}>" for i in range(50))
    assert "text" not in rclient.hgetall(keys.job_hash(job_id))  # the hash holds no copy while it runs
    assert rclient.get(keys.job_output_text(job_id)) == text
    assert rclient.get(keys.job_output_ids(job_id)) == ",".join(map(str, range(50)))
    assert job_record(rclient, job_id)["text"] == text  # what readers see: the whole output
    final = step_output(job_id, [50], "<50>", finish_reason="length")
    assert emitter.emit(running, [final]) == ([job_id], [])
    job = rclient.hgetall(keys.job_hash(job_id))
    assert job["text"] == text + "<50>" and job["token_ids"] == ",".join(map(str, range(51)))
    assert rclient.exists(keys.job_output_text(job_id), keys.job_output_ids(job_id)) == 0
    assert job_record(rclient, job_id) == job


def test_finish_exactly_once(rclient: redis.Redis, settings: ServiceSettings) -> None:
    (job_id,), running = _start(rclient, settings, 1)
    emitter = Emitter(rclient, settings)
    emitter.emit(running, [step_output(job_id, [1], "a")])
    final = step_output(
        job_id, [2], "b", finish_reason="stop", metrics={"ttft_ms": 3.5, "other": 1.0}
    )
    assert emitter.emit(running, [final]) == ([job_id], [])
    assert emitter.emit(running, [final]) == (
        [],
        [job_id],
    )  # a second finish (e.g. a racing worker) is refused
    job = job_record(rclient, job_id)
    assert job["status"] == "succeeded" and job["text"] == "ab" and job["finish_reason"] == "stop"
    assert json.loads(job["metrics"]) == {"ttft_ms": 3.5}
    events = rclient.xrange(keys.job_events(job_id))
    assert [e[1]["type"] for e in events] == ["status", "token", "token", "done"]
    assert rclient.xlen(keys.queue_stream("default")) == 0  # acked and deleted
    assert rclient.xpending(keys.queue_stream("default"), keys.CONSUMER_GROUP)["pending"] == 0
    assert 0 < rclient.ttl(keys.job_events(job_id)) <= settings.result_ttl_s


def test_fail_sets_the_error(rclient: redis.Redis, settings: ServiceSettings) -> None:
    from shared.job_state import ErrorCode

    (job_id,), running = _start(rclient, settings, 1)
    emitter = Emitter(rclient, settings)
    assert (
        emitter.fail(job_id, running[job_id].attempt, ErrorCode.PROMPT_TOO_LONG, "too long", "prompt") == "ok"
    )
    job = job_record(rclient, job_id)
    assert job["status"] == "failed" and json.loads(job["error"])["field"] == "prompt"
    assert emitter.fail(job_id, running[job_id].attempt, ErrorCode.ENGINE_ERROR, "again") == "failed"
