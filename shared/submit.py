"""The SUBMIT script's call for one job request: its KEYS and ARGV (shared/lua.py runs it).

Used alike by the gateway (POST /v1/jobs), the batch expansion task and the benchmarks. Imports only shared/.
"""

import hashlib
import json
import random
import uuid
from dataclasses import dataclass

from shared import keys, lua
from shared.batch_format import BATCH_ID_KEY
from shared.outbox import job_actions
from shared.schemas import JobRequest, Priority, WebhookEvent
from shared.settings import ServiceSettings

NOT_STORED = ("metadata", "priority", "ttl_s")  # a request's fields SUBMIT takes apart, not in its `request`


@dataclass(frozen=True)
class StoredForm:
    """A request as SUBMIT stores it: its JSON without NOT_STORED, and those fields apart."""

    json: str
    priority: Priority
    ttl_s: float | None
    metadata: dict[str, str]
    body_hash: str = ""  # what an Idempotency-Key remembers of the request ("" without a key: not read)
    # whether the Celery side acts on the job's end (its `completed` outbox notice: wants_completed_notice)
    completed_notice: bool = True

    @classmethod
    def of(cls, request: JobRequest, with_hash: bool) -> "StoredForm":
        """The fields left unset (None) are not stored: a worker of an older version, whose JobRequest lacks a field
        added since, reads every job that does not use it (it refused the whole request for a `"field": null`)."""
        body_hash = request_hash(request) if with_hash else ""
        return cls(request.model_dump_json(exclude=set(NOT_STORED), exclude_none=True), request.priority,
                   request.ttl_s, request.metadata, body_hash, wants_completed_notice(request))  # fmt: skip


def wants_completed_notice(request: JobRequest) -> bool:
    """Whether anything on the Celery side acts on the job's end (shared/outbox.py job_actions): its webhook
    wants the `completed` event, or it is a batch's line. Any other job ends without an outbox notice."""
    batch_id = request.metadata.get(BATCH_ID_KEY)
    return job_actions(WebhookEvent.COMPLETED, request.webhook, request.webhook_events_filter, batch_id).any


def queue_ttl_s(ttl_s: float | None, settings: ServiceSettings) -> float:
    """How long a job may wait to start: its `ttl_s`, else default_ttl_s; at most max_ttl_s."""
    return min(ttl_s or settings.default_ttl_s, settings.max_ttl_s)


def submit_call(
    request: JobRequest | StoredForm,
    job_id: str,
    idempotency_key: str | None,
    settings: ServiceSettings,
    ctx: str | None = None,
    owner: str = "",
) -> tuple[list[str], list[str | int]]:
    """KEYS and ARGV of the SUBMIT script for one request (`owner`: the API key id the job belongs to), in the
    partition the job id names (`ctx`, when given, must be that partition's: lua.context). A StoredForm is a
    request queued as it was stored (a batch line that does not validate any more: the worker fails its job
    naming the field)."""
    form = request if isinstance(request, StoredForm) else StoredForm.of(request, with_hash=bool(idempotency_key))
    ttl_s = queue_ttl_s(form.ttl_s, settings)
    partition = keys.partition_of(job_id)
    return (
        [
            keys.job_hash(job_id),
            keys.queue_stream(form.priority, partition),
            keys.idempotency(idempotency_key or "", partition),
        ],
        [
            ctx or lua.context(settings.events_maxlen, settings.result_ttl_s, partition, settings.jobs_listed_per_key),
            job_id,
            form.priority.value,
            repr(ttl_s),
            form.json,
            json.dumps(form.metadata),
            settings.queue_limits.for_priority(form.priority),
            settings.idempotency_ttl_s,
            "1" if idempotency_key else "0",
            owner,
            form.body_hash,  # read only with an Idempotency-Key
            "1" if form.completed_notice else "0",
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
    return body_digest(request.model_dump_json())


def body_digest(text: str) -> str:
    """The digest an Idempotency-Key keeps of a request's JSON (request_hash; a StoredForm's `body_hash`)."""
    return hashlib.sha256(text.encode()).hexdigest()[:32]
