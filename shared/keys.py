"""Every Redis key, stream, channel and consumer-group name of the fleet, in one place.

Lua scripts receive key names from here (as KEYS, or as the prefixes below when a script derives a job's
keys from a job id it read from a stream), so no key string is written anywhere else.
"""

NAMESPACE = "specfleet"
# Every key below starts with PREFIX, whose `{specfleet}` is a Redis Cluster hash tag: the whole fleet's keys
# hash to ONE slot, so every Lua script and MULTI of the protocol (each touches a job's hash and events, its
# queue stream, the outbox, the idempotency and rate-limit keys together) runs unchanged on a Cluster. The
# cost: one fleet's keys live on one shard (the README's "Redis topologies" says what spreads and what not).
PREFIX = "{" + NAMESPACE + "}:"

CONSUMER_GROUP = "workers"  # the one consumer group on every queue stream

JOB_PREFIX = f"{PREFIX}job:"  # + job id -> job hash
EVENTS_SUFFIX = ":events"  # job hash key + suffix -> the job's event stream
CHANNEL_PREFIX = f"{PREFIX}wake:"  # + job id -> pub/sub channel announcing each new event (and carrying it)

DEAD_LETTER_STREAM = f"{PREFIX}jobs:dead"  # jobs that exceeded max_deliveries
CANCEL_CHANNEL = f"{PREFIX}control:cancel"  # pub/sub: job ids whose cancel a worker must honour now
QUEUED_CHANNEL = f"{PREFIX}control:queued"  # pub/sub: a job was queued (payload: its priority)
WORKERS_ZSET = f"{PREFIX}workers"  # worker id -> unix time of its last heartbeat
HUB_CHANNEL = f"{PREFIX}hub"  # every gateway's one pub/sub connection stays subscribed here
MODEL_INFO = f"{PREFIX}model"  # hash written by workers: max_model_len, tokenizer_path, model
WORKER_VERSIONS = f"{PREFIX}workers:versions"  # hash: worker id -> the model version it serves


def queue_stream(priority: str) -> str:
    """The stream of jobs waiting at one priority (`interactive`, `default`, `batch`)."""
    return f"{PREFIX}jobs:{priority}"


def job_hash(job_id: str) -> str:
    """The hash holding a job's request, status, timestamps, partial/final output, usage and metrics."""
    return JOB_PREFIX + job_id


def job_events(job_id: str) -> str:
    """The job's ordered event log (`status`, `token`, `done`, `error`); entry ids are the SSE ids."""
    return JOB_PREFIX + job_id + EVENTS_SUFFIX


def job_channel(job_id: str) -> str:
    """The pub/sub channel on which a new event of the job is announced (shared.lua.parse_event_wake)."""
    return CHANNEL_PREFIX + job_id


def idempotency(key: str) -> str:
    """Idempotency-Key header value -> the id of the job it created."""
    return f"{PREFIX}idem:{key}"


# Lifetimes and caps of the keys above (the defaults of the matching fields in shared/settings.py).
RESULT_TTL_S = 24 * 3600  # job hash + event stream, counted from completion
IDEMPOTENCY_TTL_S = 24 * 3600  # Idempotency-Key -> job id
EVENTS_MAXLEN = 100_000  # approximate cap on one job's event stream
WORKER_TTL_S = 15  # a worker whose heartbeat is older than this is not alive
DEAD_LETTER_MAXLEN = 10_000


# -- webhooks and batches: the Celery side (workers/tasks/) ------------------------------------------------
# Every fleet process tells the Celery side what happened by appending a notice to ONE stream (a transactional
# outbox: the job protocol's finish() appends `completed` atomically with the transition, see shared/lua.py);
# a bridge inside the Celery worker turns notices into tasks (workers/tasks/outbox.py).
OUTBOX_STREAM = f"{PREFIX}outbox"  # fields: kind (job|batch), id, event, [status]
OUTBOX_GROUP = "tasks"  # the consumer group of the Celery workers' bridges
OUTBOX_MAXLEN = 100_000  # approximate cap
CELERY_KEY_PREFIX = f"{PREFIX}celery:"  # kombu's global_keyprefix: Celery's own keys live under it
CELERY_QUEUE = "tasks"  # the Celery queue name (kombu prefixes it with CELERY_KEY_PREFIX)
BATCHES_ZSET = f"{PREFIX}batches"  # batch id -> created_at (listing, newest first)
BATCH_PREFIX = f"{PREFIX}batch:"
WEBHOOK_FIELD_PREFIX = "webhook:"  # job/batch hash field prefix + event -> json outcome of its delivery


def batch_hash(batch_id: str) -> str:
    """The batch: status, `*_at` times, counts (total completed failed expanded), webhook, metadata."""
    return BATCH_PREFIX + batch_id


def batch_lines(batch_id: str) -> str:
    """List of the batch's validated input lines (json), in input order; deleted once finalized."""
    return BATCH_PREFIX + batch_id + ":lines"


def batch_jobs(batch_id: str) -> str:
    """Hash: line index -> job id, for every line already submitted as a job."""
    return BATCH_PREFIX + batch_id + ":jobs"


def batch_results(batch_id: str) -> str:
    """Hash: line index -> result line (json), written as each line finishes."""
    return BATCH_PREFIX + batch_id + ":results"


def batch_line_idempotency(batch_id: str, line: int) -> str:
    """The Idempotency-Key under which a batch line is submitted (re-expansion finds the same job)."""
    return f"batch-{batch_id}-{line}"


BATCH_RESULT_TTL_S = 7 * 24 * 3600  # a finished batch (status, results) is kept this long


# -- API keys, tenants and per-key limits (shared/api_keys.py, gateway/auth.py, gateway/rate_limit.py) -------
# A key is found by the SHA-256 of its secret (the secret itself is never stored); the index maps key ids to
# those digests for listing and revoking. Jobs and batches carry their owner's key id in an `owner` field.
API_KEY_PREFIX = f"{PREFIX}apikey:"  # + sha256 hex of the secret -> hash: the key's record
API_KEYS_INDEX = f"{PREFIX}apikeys"  # hash: key id -> sha256 hex of its secret
OWNER_FIELD = "owner"  # job / batch hash field: the id of the API key that created it


def api_key_record(digest: str) -> str:
    """The record (id name created_at revoked_at is_admin limits webhook_secret) of the key with this digest."""
    return API_KEY_PREFIX + digest


def rate_limit_state(key_id: str) -> str:
    """Hash: `requests_tat` and `tokens_tat`, the GCRA theoretical arrival times (unix s) of one key."""
    return f"{PREFIX}ratelimit:{key_id}"


def inflight_jobs(key_id: str) -> str:
    """Hash: job id -> tokens reserved for it, for every job of the key not yet seen finished."""
    return f"{PREFIX}inflight:{key_id}"


def batches_of(key_id: str) -> str:
    """Sorted set: the key's batch ids -> created_at (GET /v1/batches of a tenant, newest first)."""
    return f"{PREFIX}batches:of:{key_id}"


INFLIGHT_TTL_S = 8 * 24 * 3600  # an idle key's in-flight hash outlives any job (max_ttl_s + a run)


# -- files (OpenAI's Files API: gateway/file_store.py) -------------------------------------------------------
# An uploaded file is a metadata hash plus its bytes under a second key, so listing never reads the content.
# A finished batch's output and error files are not stored: they are views of its results (batch_results).
FILE_PREFIX = f"{PREFIX}file:"
FILES_ZSET = f"{PREFIX}files"  # file id -> created_at, every tenant's (an admin's listing)


def file_hash(file_id: str) -> str:
    """The file's record: id bytes created_at filename purpose owner."""
    return FILE_PREFIX + file_id


def file_content(file_id: str) -> str:
    """The file's bytes (a string)."""
    return FILE_PREFIX + file_id + ":content"


def files_of(key_id: str) -> str:
    """Sorted set: the key's file ids -> created_at (GET /v1/files of a tenant, newest first)."""
    return f"{PREFIX}files:of:{key_id}"
