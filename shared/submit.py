"""The SUBMIT script's call for one job request: its KEYS and ARGV (shared/lua.py runs it).

Used alike by the gateway (POST /v1/jobs), the batch expansion task and the benchmarks. Imports only shared/.
"""

import hashlib
import json
import random
import uuid

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
    """KEYS and ARGV of the SUBMIT script for one request (`owner`: the API key id the job belongs to), in the
    partition the job id names (`ctx`, when given, must be that partition's: lua.context)."""
    ttl_s = min(request.ttl_s or settings.default_ttl_s, settings.max_ttl_s)
    stored = request.model_dump_json(exclude={"metadata", "priority", "ttl_s"})
    partition = keys.partition_of(job_id)
    return (
        [
            keys.job_hash(job_id),
            keys.queue_stream(request.priority, partition),
            keys.idempotency(idempotency_key or "", partition),
        ],
        [
            ctx or lua.context(settings.events_maxlen, settings.result_ttl_s, partition),
            job_id,
            request.priority.value,
            repr(ttl_s),
            stored,
            json.dumps(request.metadata),
            settings.queue_limits.for_priority(request.priority),
            settings.idempotency_ttl_s,
            "1" if idempotency_key else "0",
            owner,
            request_hash(request) if idempotency_key else "",  # read only with an Idempotency-Key
        ],
    )


def new_job_id(partition: int) -> str:
    """A fresh job id that names its partition (shared/keys.py)."""
    return keys.mark(uuid.uuid4().hex, partition)


def partition_for(idempotency_key: str | None, settings: ServiceSettings) -> int:
    """The partition of a job submitted without a tenant: its Idempotency-Key's when it has one (a replay finds
    the first job), else any (spread at random)."""
    if idempotency_key:
        return keys.spread(idempotency_key, settings.redis_partitions)
    return random.randrange(settings.redis_partitions)


def request_hash(request: JobRequest) -> str:
    """What an Idempotency-Key remembers of its request: a replay must send the same one."""
    return hashlib.sha256(request.model_dump_json().encode()).hexdigest()[:32]
