"""The SUBMIT call's stored request: what a worker reads back, of this version or an older one."""

import json

from pydantic import ConfigDict, create_model

from shared.batch_format import BATCH_ID_KEY, BATCH_LINE_KEY
from shared.outbox import job_actions
from shared.schemas import JobRequest, WebhookEvent
from shared.settings import ServiceSettings
from shared.submit import NOT_STORED, submit_call

STORED_ARG = 4  # ARGV: ctx, job_id, priority, ttl_s, request_json, ...


def test_a_request_is_stored_without_its_unset_fields_so_an_older_worker_reads_it() -> None:
    """A worker whose JobRequest predates a field (here `prompt_token_ids`, as before it was added) refuses a
    stored `"prompt_token_ids": null` (extra fields are forbidden); unset fields are not stored."""
    request = JobRequest(prompt="def f(x):", max_tokens=8, metadata={"run": "1"})
    stored = json.loads(submit_call(request, "job1", None, ServiceSettings())[1][STORED_ARG])
    assert None not in stored.values() and not set(NOT_STORED) & set(stored)
    fields = {name: (info.annotation, info) for name, info in JobRequest.model_fields.items() if name != "prompt_token_ids"}
    older = create_model("OlderJobRequest", __config__=ConfigDict(extra="forbid"), **fields)  # type: ignore[call-overload]
    assert older.model_validate(stored).prompt == "def f(x):"
    assert JobRequest.model_validate(stored) == request.model_copy(update={"metadata": {}})


COMPLETED_NOTICE_ARG = 11  # ARGV[12]: whether the job's end writes a `completed` outbox notice


def test_a_job_ends_with_an_outbox_notice_exactly_when_the_bridge_would_act_on_it() -> None:
    """The SUBMIT's `completed_notice` and the Celery bridge's actions come from one rule (job_actions): a webhook
    that wants `completed`, or a batch's line (a batch id that names one)."""
    hook = "https://hooks.example/done"
    cases = [
        ({}, False),
        ({"webhook": hook}, True),
        ({"webhook": hook, "webhook_events_filter": ["start", "output"]}, False),
        ({"webhook": hook, "webhook_events_filter": ["completed"]}, True),
        ({"metadata": {BATCH_ID_KEY: "batch_1", BATCH_LINE_KEY: "0"}}, True),
        ({"metadata": {BATCH_ID_KEY: ""}}, False),
        ({"metadata": {"run": "1"}}, False),
    ]
    for fields, acts in cases:
        request = JobRequest(prompt="def f(x):", max_tokens=8, **fields)
        args = submit_call(request, "job1", None, ServiceSettings())[1]
        assert args[COMPLETED_NOTICE_ARG] == ("1" if acts else "0"), fields
        batch_id = request.metadata.get(BATCH_ID_KEY)
        bridge = job_actions(WebhookEvent.COMPLETED, request.webhook, request.webhook_events_filter, batch_id)
        assert bridge.any is acts, fields
    start = job_actions(WebhookEvent.START, hook, [WebhookEvent.START], "batch_1")
    assert start.webhook and not start.batch_line  # a batch line counts at its job's end only
