"""The worker's webhook notices: start when wanted, output throttled per job, nothing for plain jobs;
and the job protocol's finish() writing `completed` for the jobs the Celery side acts on."""

import redis

from shared import keys
from shared.batch_format import BATCH_ID_KEY, BATCH_LINE_KEY
from shared.schemas import JobRequest
from shared.settings import ServiceSettings
from tests.helpers.played_worker import PlayedWorker, step_output
from tests.helpers.redis_fixtures import submit_job
from workers.worker.job_hooks import JobHooks


def notices(client: redis.Redis) -> list[tuple[str, str]]:
    return [(f["id"], f["event"]) for _, f in client.xrange(keys.OUTBOX_STREAM) if f["kind"] == "job"]


def test_start_and_throttled_output(rclient: redis.Redis, settings: ServiceSettings) -> None:
    settings.webhook_output_interval_ms = 60_000
    hooks = JobHooks(rclient, settings)
    wants_all = JobRequest(prompt="x", webhook="https://example.com/h")
    only_completed = JobRequest(
        prompt="x", webhook="https://example.com/h", webhook_events_filter=["completed"]
    )
    hooks.started("a", wants_all)
    hooks.started("b", only_completed)
    hooks.started("c", JobRequest(prompt="x"))
    for _ in range(3):
        hooks.emitted([step_output(job, [1], "t") for job in ("a", "b", "c")])
    hooks.emitted([step_output("a", [2], "u", finish_reason="stop")])
    assert notices(rclient) == [("a", "start"), ("a", "output")]
    settings.webhook_output_interval_ms = 0
    hooks = JobHooks(rclient, settings)
    hooks.started("d", wants_all)
    hooks.emitted([step_output("d", [1], "t")])
    hooks.emitted([step_output("d", [], "")])  # no new tokens: nothing to tell
    hooks.emitted([step_output("d", [2], "t")])
    hooks.forget(["d"])
    hooks.emitted([step_output("d", [3], "t")])
    assert notices(rclient)[2:] == [("d", "start"), ("d", "output"), ("d", "output")]


def test_a_terminal_transition_writes_a_completed_notice_where_the_celery_side_acts_on_it(
    rclient: redis.Redis, settings: ServiceSettings
) -> None:
    """A job whose webhook wants `completed`, a batch's line and a job stored without the field (by an older
    gateway) get their notice at the end; a plain job and one whose webhook wants only `start` get none."""
    worker = PlayedWorker(rclient, settings)
    hook = "https://example.com/h"
    wants = submit_job(rclient, settings, webhook=hook, webhook_events_filter=["completed"])
    line = submit_job(rclient, settings, metadata={BATCH_ID_KEY: "batch_x", BATCH_LINE_KEY: "0"})
    older = submit_job(rclient, settings)
    rclient.hdel(keys.job_hash(older), "completed_notice")  # as an older gateway stored it
    plain = submit_job(rclient, settings)
    start_only = submit_job(rclient, settings, webhook=hook, webhook_events_filter=["start"])
    assert {rclient.hget(keys.job_hash(j), "completed_notice") for j in (plain, start_only)} == {"0"}
    ended = []
    for _ in range(5):
        job_id = worker.take()
        worker.emit(job_id, [5], "hi", finish_reason="stop")
        ended.append(job_id)
    assert sorted(ended) == sorted([wants, line, older, plain, start_only])
    assert all(rclient.hget(keys.job_hash(j), "status") == "succeeded" for j in ended)
    completed = [f for _, f in rclient.xrange(keys.OUTBOX_STREAM) if f["event"] == "completed"]
    assert sorted(f["id"] for f in completed) == sorted([wants, line, older])
    assert {(f["kind"], f["status"]) for f in completed} == {("job", "succeeded")}
