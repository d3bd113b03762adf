"""Every Redis key, stream, channel and consumer-group name of the fleet, in one place.

Lua scripts receive key names from here (as KEYS, or as the prefixes below when a script derives a job's
keys from a job id it read from a stream), so no key string is written anywhere else.

Partitions (settings.redis_partitions = N, issue 17): the fleet's keys are spread over N hash tags, BullMQ's
recipe (one tag per queue). Partition 0 is `{specfleet}` (with N = 1 every key is what it always was),
partition p > 0 is `{specfleet:p}`. Each partition is the whole single-slot protocol under its own tag: its
priority streams, jobs, idempotency keys, limit state, batches, files, outbox and dead-letter stream, so
every Lua script and MULTI still touches one slot. A tenant (API key) lives in one partition
(`tenant_partition`, from its secret's digest); every id the fleet mints names its partition (`mark`,
`partition_of`: ids of partition 0 carry no mark, so ids minted before partitions read as partition 0), and
the key functions below take the id and derive the partition: no lookup. What stays global, on partition 0:
the worker registry, model info and versions, the API-key index, the admin listings of batches and files,
Celery's keys; pub/sub channels are not keys (a Cluster broadcasts PUBLISH), so they stay as they are.
"""

import hashlib
import re
from collections.abc import Callable, Iterable
from typing import TypeVar

NAMESPACE = "specfleet"


def prefix(partition: int) -> str:
    """`{specfleet}:` (partition 0) or `{specfleet:p}:`: the start, and the Cluster hash tag, of its keys."""
    if partition == 0:
        return "{" + NAMESPACE + "}:"
    return "{" + f"{NAMESPACE}:{int(partition)}" + "}:"


# Partition 0's prefix: every global key below starts with it. Its `{specfleet}` is a Redis Cluster hash tag:
# the keys of one partition hash to ONE slot, so every Lua script and MULTI of the protocol (each touches a
# job's hash and events, its queue stream, the outbox, the idempotency and rate-limit keys together) runs
# unchanged on a Cluster (the README's "Redis topologies" says what spreads and what not).
PREFIX = prefix(0)

# An id minted in partition p > 0 ends with PARTITION_MARK + p (`3f..a9P2`, `batch_3f..P2`, `key_..P1`). The
# ids minted before (uuid hex, `batch_<hex>`, `file-<hex>`, `key_<hex>`) hold no capital P: partition 0.
PARTITION_MARK = "P"
_MARKED = re.compile(PARTITION_MARK + r"([1-9][0-9]{0,5})$")


def mark(object_id: str, partition: int) -> str:
    """A newly minted id -> the id that names its partition (unchanged for partition 0)."""
    return object_id if partition == 0 else f"{object_id}{PARTITION_MARK}{int(partition)}"


def partition_of(object_id: str) -> int:
    """The partition an id was minted in (0 for an unmarked id, as every id minted before partitions)."""
    found = _MARKED.search(object_id)
    return int(found.group(1)) if found else 0


T = TypeVar("T")


def by_partition(items: Iterable[T], id_of: Callable[[T], str]) -> dict[int, list[T]]:
    """`items` grouped by the partition their id (`id_of(item)`) names, in their order within each."""
    found: dict[int, list[T]] = {}
    for item in items:
        found.setdefault(partition_of(id_of(item)), []).append(item)
    return found


def spread(text: str, num_partitions: int) -> int:
    """A partition picked deterministically from `text` (an Idempotency-Key: the same key, the same partition)."""
    return int.from_bytes(hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()[:8], "big") % num_partitions


def tenant_partition(digest: str, num_partitions: int) -> int:
    """The partition of a tenant: from the SHA-256 hex of its API key's secret (what the gateway has at auth
    time), so its key record, limit state, jobs, batches and files share one tag."""
    return int(digest[:16], 16) % num_partitions


CONSUMER_GROUP = "workers"  # the one consumer group on every queue stream

JOB_PREFIX = f"{PREFIX}job:"  # + job id -> job hash (partition 0's; job_prefix(p) for another)
EVENTS_SUFFIX = ":events"  # job hash key + suffix -> the job's event stream
# job hash key + suffix -> what a started job emitted since it last ended (strings, APPENDed a step at a time;
# folded into the hash's text / token_ids when it ends): a step writes its new tokens, not the whole output again
OUTPUT_TEXT_SUFFIX = ":out:text"
OUTPUT_IDS_SUFFIX = ":out:ids"  # csv
CHANNEL_PREFIX = f"{PREFIX}wake:"  # + job id -> pub/sub channel announcing each new event (and carrying it)

DEAD_LETTER_STREAM = f"{PREFIX}jobs:dead"  # partition 0's stream of jobs that exceeded max_deliveries
CANCEL_CHANNEL = f"{PREFIX}control:cancel"  # pub/sub: job ids whose cancel a worker must honour now
QUEUED_CHANNEL = f"{PREFIX}control:queued"  # pub/sub: a job was queued (payload: its priority)
WORKERS_ZSET = f"{PREFIX}workers"  # worker id -> unix time of its last heartbeat
MODEL_INFO = f"{PREFIX}model"  # hash written by workers: max_model_len, tokenizer_path, model
WORKER_VERSIONS = f"{PREFIX}workers:versions"  # hash: worker id -> the model version it serves


def job_prefix(partition: int) -> str:
    """+ job id -> the hash of a job of this partition (the Lua scripts' ctx.jprefix)."""
    return prefix(partition) + "job:"


def dead_letter_stream(partition: int) -> str:
    """The partition's stream of jobs that exceeded max_deliveries (fields id, queue, entry)."""
    return prefix(partition) + "jobs:dead"


def queue_stream(priority: str, partition: int = 0) -> str:
    """The stream of jobs waiting at one priority (`interactive`, `default`, `batch`) in one partition."""
    return f"{prefix(partition)}jobs:{priority}"


def job_hash(job_id: str) -> str:
    """The hash holding a job's request, status, timestamps, partial/final output, usage and metrics."""
    return job_prefix(partition_of(job_id)) + job_id


def job_output_text(job_id: str) -> str:
    """The text a running job emitted since it last ended (shared.lua READ_JOB gives the whole output)."""
    return job_hash(job_id) + OUTPUT_TEXT_SUFFIX


def job_output_ids(job_id: str) -> str:
    """The token ids (csv) a running job emitted since it last ended."""
    return job_hash(job_id) + OUTPUT_IDS_SUFFIX


def job_events(job_id: str) -> str:
    """The job's ordered event log (`status`, `token`, `done`, `error`); entry ids are the SSE ids."""
    return job_hash(job_id) + EVENTS_SUFFIX


def job_channel(job_id: str) -> str:
    """The pub/sub channel on which a new event of the job is announced (shared.lua.parse_event_wake)."""
    return CHANNEL_PREFIX + job_id


def idempotency(key: str, partition: int = 0) -> str:
    """Idempotency-Key header value -> the id of the job it created (in the partition the key picked)."""
    return f"{prefix(partition)}idem:{key}"


# Lifetimes and caps of the keys above (the defaults of the matching fields in shared/settings.py).
RESULT_TTL_S = 24 * 3600  # job hash + event stream, counted from completion
IDEMPOTENCY_TTL_S = 24 * 3600  # Idempotency-Key -> job id
EVENTS_MAXLEN = 100_000  # approximate cap on one job's event stream
WORKER_TTL_S = 15  # a worker whose heartbeat is older than this is not alive
DEAD_LETTER_MAXLEN = 10_000
JOBS_LISTED_PER_KEY = 10_000  # a key's listing (jobs_of) keeps its newest jobs, this many


# -- webhooks and batches: the Celery side (workers/tasks/) ------------------------------------------------
# Every fleet process tells the Celery side what happened by appending a notice to its partition's stream (a
# transactional outbox: the job protocol's finish() appends `completed` atomically with the transition, see
# shared/lua.py); a bridge inside the Celery worker turns notices into tasks (workers/tasks/outbox.py).
OUTBOX_STREAM = f"{PREFIX}outbox"  # partition 0's; fields: kind (job|batch), id, event, [status]
OUTBOX_GROUP = "tasks"  # the consumer group of the Celery workers' bridges
OUTBOX_MAXLEN = 100_000  # approximate cap
CELERY_KEY_PREFIX = f"{PREFIX}celery:"  # kombu's global_keyprefix: Celery's own keys live under it
CELERY_QUEUE = "tasks"  # the Celery queue name (kombu prefixes it with CELERY_KEY_PREFIX)
BATCHES_ZSET = f"{PREFIX}batches"  # batch id -> created_at, every partition's (an admin's listing, newest first)
WEBHOOK_FIELD_PREFIX = "webhook:"  # job/batch hash field prefix + event -> json outcome of its delivery
# job hash field: a stored OpenAI response's record (shared/openai_response_object.ResponseRecord, JSON); it
# lives and expires with its job's hash (result_ttl_s after the job ends)
RESPONSE_FIELD = "openai_response"


def outbox_stream(partition: int) -> str:
    """The partition's outbox stream (notices of its jobs and batches)."""
    return prefix(partition) + "outbox"


def batch_hash(batch_id: str) -> str:
    """The batch: status, `*_at` times, counts (total completed failed expanded), webhook, metadata."""
    return f"{prefix(partition_of(batch_id))}batch:{batch_id}"


def batch_lines(batch_id: str) -> str:
    """List of the batch's validated input lines (json), in input order; deleted once finalized."""
    return batch_hash(batch_id) + ":lines"


def batch_jobs(batch_id: str) -> str:
    """Hash: line index -> job id, for every line already submitted as a job."""
    return batch_hash(batch_id) + ":jobs"


def batch_results(batch_id: str) -> str:
    """Hash: line index -> result line (json), written as each line finishes."""
    return batch_hash(batch_id) + ":results"


def batch_line_idempotency(batch_id: str, line: int) -> str:
    """The Idempotency-Key under which a batch line is submitted (re-expansion finds the same job)."""
    return f"batch-{batch_id}-{line}"


BATCH_RESULT_TTL_S = 7 * 24 * 3600  # a finished batch (status, results) is kept this long


# -- API keys, tenants and per-key limits (shared/api_keys.py, gateway/auth.py, gateway/rate_limit.py) -------
# A key is found by the SHA-256 of its secret (the secret itself is never stored); the index maps key ids to
# those digests for listing and revoking. Jobs and batches carry their owner's key id in an `owner` field.
# A key's record lives in its tenant's partition (tenant_partition of the digest), and its id is marked with it,
# so the limit state, batches and files of a key id are found from the id alone.
API_KEYS_INDEX = f"{PREFIX}apikeys"  # hash: key id -> sha256 hex of its secret (global, partition 0)
OWNER_FIELD = "owner"  # job / batch hash field: the id of the API key that created it


def api_key_record(digest: str, partition: int) -> str:
    """The record (id name created_at revoked_at is_admin limits webhook_secret) of the key with this digest,
    in its tenant's partition (tenant_partition(digest, N) at auth time, partition_of(key id) from the index)."""
    return f"{prefix(partition)}apikey:{digest}"


def rate_limit_prefix(partition: int) -> str:
    """+ key id -> its rate_limit_state (the Lua scripts' ctx.rlprefix)."""
    return prefix(partition) + "ratelimit:"


def inflight_prefix(partition: int) -> str:
    """+ key id -> its inflight_jobs (the Lua scripts' ctx.inflightprefix)."""
    return prefix(partition) + "inflight:"


def rate_limit_state(key_id: str) -> str:
    """Hash: `requests_tat` and `tokens_tat`, the GCRA theoretical arrival times (unix s) of one key."""
    return rate_limit_prefix(partition_of(key_id)) + key_id


def inflight_jobs(key_id: str) -> str:
    """Hash: job id -> tokens reserved for it, for every job of the key not yet seen finished."""
    return inflight_prefix(partition_of(key_id)) + key_id


def created_by(kind: str, key_id: str, idempotency_key: str) -> str:
    """String: the `kind` (batch, file) an API key's Idempotency-Key made, `<id>:<digest of its input>` (in the key's
    partition: the slot of what it creates; gateway/idempotency.py)."""
    return f"{prefix(partition_of(key_id))}idem:{kind}:{key_id}:{idempotency_key}"


def jobs_of(key_id: str) -> str:
    """Sorted set: the key's newest job ids -> created_at (GET /v1/jobs, newest first; the SUBMIT script adds each
    job and keeps the newest settings.jobs_listed_per_key)."""
    return jobs_of_prefix(partition_of(key_id)) + key_id


def jobs_of_prefix(partition: int) -> str:
    return f"{prefix(partition)}jobs:of:"


def batches_of(key_id: str) -> str:
    """Sorted set: the key's batch ids -> created_at (GET /v1/batches of a tenant, newest first)."""
    return f"{prefix(partition_of(key_id))}batches:of:{key_id}"


INFLIGHT_TTL_S = 8 * 24 * 3600  # an idle key's in-flight hash outlives any job (max_ttl_s + a run)


# -- files (OpenAI's Files API: gateway/file_store.py) -------------------------------------------------------
# An uploaded file is a metadata hash plus its bytes under a second key, so listing never reads the content.
# A finished batch's output and error files are not stored: they are views of its results (batch_results).
FILES_ZSET = f"{PREFIX}files"  # file id -> created_at, every tenant's (an admin's listing; global)


def file_hash(file_id: str) -> str:
    """The file's record: id bytes created_at filename purpose owner."""
    return f"{prefix(partition_of(file_id))}file:{file_id}"


def file_content(file_id: str) -> str:
    """The file's bytes (a string)."""
    return file_hash(file_id) + ":content"


def files_of(key_id: str) -> str:
    """Sorted set: the key's file ids -> created_at (GET /v1/files of a tenant, newest first)."""
    return f"{prefix(partition_of(key_id))}files:of:{key_id}"


def unlisted(object_id: str) -> str:
    """String: the listing score (created_at) of a file or batch taken out of its listings, kept
    UNLISTED_TTL_S, so that a page that ended on it still continues (gateway/listing.py)."""
    return f"{prefix(partition_of(object_id))}unlisted:{object_id}"


UNLISTED_TTL_S = 24 * 3600  # a client paging through a listing resumes after a removed id for a day
