"""Dead letters: jobs that exhausted `max_deliveries` (their worker died each time they ran).

The PULL script (shared/lua.py) appends such a job to its partition's dead-letter stream
(keys.dead_letter_stream: fields id, queue, entry) and fails it with `max_deliveries_exceeded`. `specfleet dlq`
(shared/cli/dlq.py) lists them (every partition's), retries one, or purges the streams. A retry (the RETRY script
below, one atomic step) is the one exception to the job state machine (shared/job_state.py
`DEAD_LETTER_RETRY_FROM`): failed -> queued, with a new queue entry at the tail of its priority, its deliveries
counted from 0, a fresh `ttl_s` window (settings.default_ttl_s) and its execution deadline restarted
(`retried_at`, workers/worker/deadlines.py); its output so far stays, so the next worker resumes after it. Its
result TTL is lifted until it finishes again.
A batch line's job: after the retry, REOPEN_LINE (shared/batch_lua.py) forgets the line's failed result while
the batch is in progress, so the retried job's result is what the batch's output file gets. A batch already
finalizing or finished keeps the failure (its files are written); the retried job still runs and its result
stays on the job. The two steps are two calls (the job's keys and the batch's are apart): a crash between
them leaves the line counted failed, as it was before the retry.
"""

import json
from dataclasses import dataclass

import redis

from shared import batch_lua, keys, lua
from shared import redis_url as redis_urls
from shared.batch_format import BATCH_ID_KEY, BATCH_LINE_KEY
from shared.job_state import ErrorCode
from shared.settings import ServiceSettings

# KEYS: job hash, event stream, dead-letter stream. ARGV: ctx job_id ttl_s max_code dead_entry_id...
# -> 'ok' | 'missing' | 'not_dead' (the job is not failed with max_deliveries_exceeded: nothing changed)
RETRY = (
    lua.PRELUDE
    + """
local st, err, prio = unpack(redis.call('HMGET', KEYS[1], 'status', 'error', 'priority'))
if not st then return 'missing' end
if st ~= S_FAILED or not err or cjson.decode(err).code ~= ARGV[4] then return 'not_dead' end
local t = now()
local entry = redis.call('XADD', ctx.qprefix .. prio, '*', 'id', ARGV[2])
redis.call('HDEL', KEYS[1], 'completed_at', 'error', 'finish_reason')
redis.call('HSET', KEYS[1], 'status', S_QUEUED, 'entry', entry, 'deliveries', '0', 'worker', '', 'retried_at', t,
  'expires_at', string.format('%.6f', tonumber(t) + tonumber(ARGV[3])))
redis.call('PERSIST', KEYS[1])
redis.call('PERSIST', KEYS[2])
event(ctx, KEYS[2], ARGV[2], 'status', cjson.encode({status=S_QUEUED, retried=true}))
for i = 5, #ARGV do redis.call('XDEL', KEYS[3], ARGV[i]) end
return 'ok'
"""
)


@dataclass
class DeadLetter:
    job_id: str
    entry_id: str  # in the dead-letter stream (its time: when the job was dead-lettered)
    queue: str
    status: str  # the job's status now ('gone': its record expired)
    priority: str
    completion_tokens: int  # output kept so far (a retry resumes after it)
    deliveries: int
    created_at: float | None

    def public(self) -> dict[str, object]:
        return dict(self.__dict__)


class DeadLetters:
    def __init__(self, client: redis.Redis, settings: ServiceSettings) -> None:
        self.redis = client
        self.settings = settings
        self._retry = client.register_script(RETRY)
        self._reopen_line = client.register_script(batch_lua.REOPEN_LINE)

    def _entries(self, partition: int) -> list[tuple[str, dict[str, str]]]:
        stream = keys.dead_letter_stream(partition)
        entries: list[tuple[str, dict[str, str]]] = self.redis.xrange(stream)  # type: ignore[assignment]
        return entries

    def _letters(self, partition: int) -> list[DeadLetter]:
        entries = self._entries(partition)
        pipe = redis_urls.pipeline(self.redis, transaction=False, partition=partition)
        for _, fields in entries:
            pipe.hmget(keys.job_hash(fields["id"]), "status", "priority", "completion_tokens", "deliveries",
                       "created_at")
        letters = []
        for (entry_id, fields), (status, priority, tokens, deliveries, created) in zip(
            entries, pipe.execute(), strict=True
        ):
            letters.append(DeadLetter(
                job_id=fields["id"],
                entry_id=entry_id,
                queue=fields.get("queue", ""),
                status=status or "gone",
                priority=priority or "",
                completion_tokens=int(tokens or 0),
                deliveries=int(deliveries or 0),
                created_at=float(created) if created else None,
            ))
        return letters

    def list(self) -> list[DeadLetter]:
        """Every dead-lettered job, oldest first within each partition, partition by partition."""
        letters = []
        for partition in range(self.settings.redis_partitions):
            letters += self._letters(partition)
        return letters

    def retry(self, job_id: str) -> str:
        """Re-enqueue a dead-lettered job with its partial output -> 'ok' | 'missing' | 'not_dead'."""
        partition = keys.partition_of(job_id)  # its dead letter is in its own partition's stream
        entry_ids = [e for e, fields in self._entries(partition) if fields.get("id") == job_id]
        result = self._retry(
            keys=[keys.job_hash(job_id), keys.job_events(job_id), keys.dead_letter_stream(partition)],
            args=[lua.context(self.settings.events_maxlen, self.settings.result_ttl_s, partition), job_id,
                  repr(self.settings.default_ttl_s), ErrorCode.MAX_DELIVERIES.value, *entry_ids],
        )
        return str(result)

    def reopen_batch_line(self, job_id: str) -> tuple[str, str] | None:
        """After a retry: un-count the job's batch line -> (batch id, REOPEN_LINE's answer), None if no batch's."""
        raw = self.redis.hget(keys.job_hash(job_id), "metadata")  # SUBMIT keeps it apart from the request
        metadata = json.loads(str(raw)) if raw else {}
        batch_id, line = metadata.get(BATCH_ID_KEY), metadata.get(BATCH_LINE_KEY)
        if not batch_id or line is None:
            return None
        answer = self._reopen_line(keys=[keys.batch_hash(batch_id), keys.batch_results(batch_id)], args=[line])
        return batch_id, str(answer)

    def purge(self) -> int:
        """Empty every partition's dead-letter stream (the jobs stay failed until their result TTL) -> entries
        removed."""
        count = 0
        for partition in range(self.settings.redis_partitions):
            stream = keys.dead_letter_stream(partition)
            count += int(self.redis.xlen(stream))  # type: ignore[arg-type]
            self.redis.delete(stream)
        return count

