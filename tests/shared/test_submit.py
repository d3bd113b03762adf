"""The SUBMIT call's stored request: what a worker reads back, of this version or an older one."""

import json

from pydantic import ConfigDict, create_model

from shared.schemas import JobRequest
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
