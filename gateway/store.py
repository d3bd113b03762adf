"""The gateway's Redis side (a client with decode_responses=True) of jobs: submit (one script: idempotency, queue
limit, hash, enqueue; its KEYS/ARGV from shared/submit.py; with the caller's key and its limits in front of it:
AUTH_ADMIT_SUBMIT, one round trip), read, cancel."""

import asyncio
from dataclasses import dataclass
from typing import cast

from redis.asyncio import Redis
from redis.exceptions import ResponseError

from gateway.listing import live_page
from gateway.redis_batch import CommandBatcher, ScriptBatcher
from gateway.redis_wire import WireConnection
from shared import keys, lua
from shared.job_state import ErrorCode, JobStatus
from shared.schemas import ErrorEvent, ErrorInfo, JobRequest, Priority
from shared.settings import ServiceSettings
from shared.submit import request_hash, submit_call


@dataclass
class Submitted:
    job_id: str
    is_new: bool  # False: an earlier job with the same Idempotency-Key
    created_at: float | None = None  # of a new job (Redis clock)


@dataclass
class AuthSubmit:
    """AUTH_ADMIT_SUBMIT's answer (shared/lua.py)."""

    verdict: str  # 'unknown' | 'revoked' | 'too_large' | 'refused' (the limits) | 'submitted'
    key_fields: dict[str, str]  # the key's record ({} when unknown)
    result: list[str]  # submit()'s answer when verdict is 'submitted' (JobStore.submitted_of reads it); else []
    decision: list[object]  # the limits' answer (admit() in shared/lua.py); [] when they were not checked


class IdempotencyConflict(Exception):
    """The Idempotency-Key already names a job created from a different request."""

    def __init__(self, job_id: str) -> None:
        super().__init__(f"this Idempotency-Key was already used for a different request (job {job_id})")
        self.job_id = job_id


class QueueFull(Exception):
    def __init__(self, priority: Priority, depth: int) -> None:
        super().__init__(f"the {priority.value} queue holds {depth} jobs, its limit")
        self.depth = depth


class JobStore:
    def __init__(self, redis: Redis, settings: ServiceSettings, wire: WireConnection | None = None) -> None:
        self.redis = redis
        self.settings = settings
        self._contexts = lua.contexts(
            settings.events_maxlen, settings.result_ttl_s, settings.redis_partitions, settings.jobs_listed_per_key
        )
        # `wire`: the process's command connection (gateway/redis_wire.py), which the batchers send on
        # each submit written at once: its job is created while the gateway handles the requests that came with it
        self.auth_submits = ScriptBatcher(redis, lua.AUTH_ADMIT_SUBMIT, wire=wire, eager=True)
        # concurrent requests' reads (keys, jobs, batches): one write a loop turn, not a pooled connection each
        self.reads = CommandBatcher(redis, wire=wire)
        self.read_jobs = ScriptBatcher(redis, lua.READ_JOB, wire=wire)  # a job with its output, at one instant
        self._finish = redis.register_script(lua.FINISH)
        self._hset_if_exists = redis.register_script(lua.HSET_IF_EXISTS)
        cancelled = ErrorInfo(code=ErrorCode.CANCELLED, message="the job was cancelled")
        self._cancel_error = cancelled.model_dump_json(exclude_none=True)
        self._cancel_event = ErrorEvent(status=JobStatus.CANCELLED, error=cancelled).model_dump_json(
            exclude_none=True
        )

    @property
    def partitions(self) -> range:
        return range(self.settings.redis_partitions)

    def _ctx(self, partition: int) -> str:
        """The scripts' context of a partition (one that no longer exists, of an id minted when there were more
        partitions: built on the spot)."""
        if partition < len(self._contexts):
            return self._contexts[partition]
        settings = self.settings
        return lua.context(settings.events_maxlen, settings.result_ttl_s, partition, settings.jobs_listed_per_key)

    def tenant_partition(self, key_digest: str) -> int:
        """The partition of the tenant whose key has this digest: its record, limits and new jobs are there."""
        return keys.tenant_partition(key_digest, self.settings.redis_partitions)

    async def ensure_groups(self) -> None:
        """Create the consumer group on every queue stream of every partition (idempotent), so queue depth is
        known at once."""
        for partition in self.partitions:
            for priority in Priority:
                try:
                    await self.redis.xgroup_create(
                        keys.queue_stream(priority, partition), keys.CONSUMER_GROUP, id="0", mkstream=True
                    )
                except ResponseError as exc:
                    if "BUSYGROUP" not in str(exc):
                        raise

    async def auth_admit_submit(
        self,
        request: JobRequest,
        key_digest: str,
        idempotency_key: str | None,
        job_id: str,
        cost: int,
        counts_request: bool = True,  # False: another job of a call already counted (an OpenAI call's choices)
    ) -> AuthSubmit:
        """Who is calling (the record of the key with this digest), its limits and the submit: ONE round trip
        (AUTH_ADMIT_SUBMIT) -> the verdict. A job not created gave its reservation back. `job_id` names the
        tenant's partition (tenant_partition): the key record, its limits and the job share its tag."""
        partition = keys.partition_of(job_id)
        keys_, args = submit_call(request, job_id, idempotency_key, self.settings, self._ctx(partition))
        reply = await self.auth_submits.run(
            [keys.api_key_record(key_digest, partition), keys_[0], keys_[1]],
            [*args, idempotency_key or "", cost, repr(self.settings.rate_limit_period_s), keys.INFLIGHT_TTL_S,
             int(counts_request)],
        )
        verdict, record, result, decision = cast(tuple[str, list[str], list[str], list[object]], reply)
        return AuthSubmit(verdict, dict(zip(record[::2], record[1::2], strict=True)), result, decision)

    @staticmethod
    def submitted_of(request: JobRequest, result: list[str]) -> Submitted:
        """SUBMIT's answer -> the job (raises QueueFull, IdempotencyConflict)."""
        if result[0] == "full":
            raise QueueFull(request.priority, int(result[1]))
        if result[0] == "dup":
            if result[2] and result[2] != request_hash(request):  # '' = an entry from before hashes
                raise IdempotencyConflict(result[1])
            return Submitted(job_id=result[1], is_new=False)
        return Submitted(job_id=result[1], is_new=True, created_at=float(result[2]))

    async def get(self, job_id: str) -> dict[str, str] | None:
        fields = lua.fields_of(await self.read_jobs.run(lua.read_job_keys(job_id), []))
        return fields or None

    async def keep_response(self, job_id: str, record: str) -> bool:
        """A stored OpenAI response's record, beside its job (keys.RESPONSE_FIELD) -> False if the job is gone."""
        return bool(await self._hset_if_exists(keys=[keys.job_hash(job_id)], args=[keys.RESPONSE_FIELD, record]))

    async def drop_response(self, job_id: str) -> bool:
        """Forget a stored response (its job stays) -> whether there was one."""
        return bool(await self.redis.hdel(keys.job_hash(job_id), keys.RESPONSE_FIELD))  # type: ignore[misc]

    async def page(
        self, owner: str, limit: int, after: str | None, status: JobStatus | None = None
    ) -> tuple[list[dict[str, str]], bool]:
        """Up to `limit` of the owner's jobs (keys.jobs_of), newest first, after job `after`, in `status` if given
        -> (records, has_more); a job whose record expired leaves the listing (gateway/listing.py). LookupError:
        an unknown `after`."""

        async def records_of(job_ids: list[str]) -> list[dict[str, str] | None]:
            return list(await asyncio.gather(*(self.get(job_id) for job_id in job_ids)))

        def in_status(fields: dict[str, str]) -> bool:
            return status is None or fields["status"] == status.value

        return await live_page(self.redis, keys.jobs_of(owner), after, limit, records_of, in_status)

    async def cancel(self, job_id: str) -> str:
        """-> 'ok' | 'missing' | the job's (terminal) status."""
        result = await self._finish(
            keys=[keys.job_hash(job_id), keys.job_events(job_id)],
            args=[
                self._ctx(keys.partition_of(job_id)),
                job_id,
                JobStatus.CANCELLED.value,
                "",
                "error",
                self._cancel_event,
                "error",
                self._cancel_error,
            ],
        )
        return str(result)

    async def queue_depths(self) -> dict[str, int]:
        """Per priority, the entries of its streams, summed over the partitions."""
        depths = dict.fromkeys([p.value for p in Priority], 0)
        streams = [(priority, partition) for partition in self.partitions for priority in Priority]
        pipe = self.redis.pipeline(transaction=False)  # one round trip (a Cluster's pipeline splits by slot)
        for priority, partition in streams:
            pipe.xlen(keys.queue_stream(priority, partition))
        for (priority, _), depth in zip(streams, await pipe.execute(), strict=True):
            depths[priority.value] += int(depth)
        return depths

    async def oldest_waiting_age_s(self) -> dict[str, float]:
        """Per priority, how long the oldest job that no worker has taken yet has waited (0: none waits), over
        every partition: the first entry after the consumer group's last-delivered id, aged by its id's time
        (Redis clock)."""
        seconds, micros = await self.redis.time()
        now_ms = seconds * 1000 + micros // 1000
        ages = dict.fromkeys([p.value for p in Priority], 0.0)
        streams = [(priority, keys.queue_stream(priority, n)) for n in self.partitions for priority in Priority]
        pipe = self.redis.pipeline(transaction=False)  # two round trips in all, not two per stream
        for _, stream in streams:
            pipe.xinfo_groups(stream)
        last_ids = []
        for groups in await pipe.execute(raise_on_error=False):
            if isinstance(groups, ResponseError):  # no stream yet: nothing waits
                groups = []
            last_ids.append(next((g["last-delivered-id"] for g in groups if g["name"] == keys.CONSUMER_GROUP), "0-0"))
        for (_, stream), last_id in zip(streams, last_ids, strict=True):
            pipe.xrange(stream, min=f"({last_id}", count=1)
        for (priority, _), oldest in zip(streams, await pipe.execute(), strict=True):
            enqueued_ms = int(str(oldest[0][0]).split("-")[0]) if oldest else now_ms
            ages[priority.value] = max(ages[priority.value], (now_ms - enqueued_ms) / 1000)
        return ages

    async def num_workers_alive(self, now_s: float) -> int:
        return int(await self.redis.zcount(keys.WORKERS_ZSET, now_s - self.settings.worker_ttl_s, "+inf"))
