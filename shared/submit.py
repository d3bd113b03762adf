"""The SUBMIT script's call for one job request: its KEYS and ARGV (shared/lua.py runs it).

Used alike by the gateway (POST /v1/jobs), the batch expansion task and the benchmarks. Imports only shared/.
"""

import hashlib
import json

from shared import keys, lua
from shared.schemas import JobRequest
from shared.settings import ServiceSettings


def submit_call(
    request: JobRequest,
    job_id: str,
    idempotency_key: str | None,
    settings: ServiceSettings,
    ctx: str | None = None,
    owner: str = "",
) -> tuple[list[str], list[str | int]]:
    """KEYS and ARGV of the SUBMIT script for one request (`owner`: the API key id the job belongs to)."""
    ttl_s = min(request.ttl_s or settings.default_ttl_s, settings.max_ttl_s)
    stored = request.model_dump_json(exclude={"metadata", "priority", "ttl_s"})
    return (
        [keys.job_hash(job_id), keys.queue_stream(request.priority), keys.idempotency(idempotency_key or "")],
        [
            ctx or lua.context(settings.events_maxlen, settings.result_ttl_s),
            job_id,
            request.priority.value,
            repr(ttl_s),
            stored,
            json.dumps(request.metadata),
            settings.queue_limits.for_priority(request.priority),
            settings.idempotency_ttl_s,
            "1" if idempotency_key else "0",
            owner,
            request_hash(request),
        ],
    )


def request_hash(request: JobRequest) -> str:
    """What an Idempotency-Key remembers of its request: a replay must send the same one."""
    return hashlib.sha256(request.model_dump_json().encode()).hexdigest()[:32]
