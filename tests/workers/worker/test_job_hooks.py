"""The worker's webhook notices: start when wanted, output throttled per job, nothing for plain jobs;
and the job protocol's finish() writing `completed` for every terminal transition."""

import redis

from shared import keys
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


def test_every_terminal_transition_writes_a_completed_notice(
    rclient: redis.Redis, settings: ServiceSettings
) -> None:
    worker = PlayedWorker(rclient, settings)
    done = submit_job(rclient, settings)
    worker.take()
    worker.emit(done, [5], "hi", finish_reason="stop")
    completed = [f for _, f in rclient.xrange(keys.OUTBOX_STREAM) if f["event"] == "completed"]
    assert completed == [{"kind": "job", "id": done, "event": "completed", "status": "succeeded"}]
