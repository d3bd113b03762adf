"""Taking jobs off the queue streams: highest priority first, anti-starvation, only as many as fit.

A PULL script call (shared/lua.py) reclaims entries of dead workers (XAUTOCLAIM, every `reclaim_interval_s`),
then reads its streams one at a time in priority order (a multi-stream XREADGROUP would not honour priority)
and starts each job atomically: with one partition, one call for all the streams. A script touches one
partition (shared/keys.py: one hash tag), so a pull with N > 1 partitions goes priority by priority, and within
a priority partition by partition, one call each, starting at another partition each pull (fairness): every
partition's interactive jobs before any default one. Once the engine's room is taken, the streams not visited
yet are only looked at (one call per partition, n = 0, pipelined). When nothing is waiting, the worker blocks on
a plain XREAD of every stream after the last ids the scripts saw, so no job that arrives meanwhile is missed (on
a Cluster, where one XREAD cannot span hash tags, partition by partition for a share of the block each). With
one partition on a held connection, its next PULL goes in the same write behind that XREAD (`wait_and_pull`):
Redis runs a blocked client's next command as soon as the block ends, so a job that wakes the worker comes
back started, with the wake-up.
"""

import time
from dataclasses import dataclass, field
from typing import Any

import redis
import redis.cluster
from redis.exceptions import NoScriptError, ResponseError

from shared import keys, lua
from shared import redis_url as redis_urls
from shared.job_record import parse_token_ids
from shared.job_state import ErrorCode, JobStatus
from shared.schemas import ErrorEvent, ErrorInfo, JobRequest, Priority, StoredRequestError, stored_request
from shared.settings import ServiceSettings
from workers.worker.deadlines import JobClock


@dataclass
class Lease:
    """A job this worker holds: its queue entry, its current attempt, and output of earlier attempts."""

    job_id: str
    entry_id: str
    priority: Priority
    attempt: int
    request: JobRequest | StoredRequestError  # the error: its stored request does not validate (the job fails)
    resumed_text: str = ""  # produced by earlier attempts (this one continues after it)
    resumed_token_ids: list[int] = field(default_factory=list)
    clock: JobClock | None = None  # created / first started / retried (unix s): the execution deadline's base

    @property
    def partition(self) -> int:
        """The partition of the job (its id names it): where its keys and queue stream are."""
        return keys.partition_of(self.job_id)


class PriorityOrder:
    """Highest priority first, except that a priority passed over `starvation_limit` times while it had
    waiting jobs is read first next time (its count then restarts)."""

    def __init__(self, starvation_limit: int) -> None:
        self.starvation_limit = starvation_limit
        self.num_passed_over = {p: 0 for p in Priority}

    def order(self) -> list[Priority]:
        starved = [p for p in Priority if self.num_passed_over[p] >= self.starvation_limit]
        return starved + [p for p in Priority if p not in starved]

    def record(self, taken: list[Priority], waiting: dict[Priority, bool]) -> None:
        """After a pull: which priorities gave jobs, and which still have jobs waiting."""
        for priority in Priority:
            if priority in taken:
                self.num_passed_over[priority] = 0
            elif taken and waiting[priority]:
                self.num_passed_over[priority] += len(taken)


def _error_json(status: JobStatus, code: ErrorCode, message: str) -> tuple[str, str]:
    info = ErrorInfo(code=code, message=message)
    return info.model_dump_json(exclude_none=True), ErrorEvent(status=status, error=info).model_dump_json(
        exclude_none=True
    )


Stream = tuple[int, Priority]  # (partition, priority) -> one queue stream
MAX_JOBS_ARG = 2  # where a PULL call's arguments (QueueReader._args) put how many jobs it may start


def unseen_entries(announced: dict[Priority, str | None], seen: dict[Priority, str]) -> dict[Priority, str | None]:
    """The announcements (control.py) of entries newer than the newest seen on their queue, or that name none."""
    return {
        priority: entry for priority, entry in announced.items()
        if entry is None or lua.entry_key(entry) > lua.entry_key(seen[priority])
    }  # fmt: skip


@dataclass(frozen=True)
class PullCall:
    """One PULL of every queue stream of the one partition, in priority order, as a command that another
    connection sends (workers/worker/puller.py); its reply is read back by QueueReader.read_pulled."""

    order: list[Priority]
    sha: str
    keys: list[str]
    args: list[str | int]  # args[MAX_JOBS_ARG]: how many jobs it may start (command() sets it)
    last_ids: dict[Priority, str]  # the newest entry per queue that the pulls so far saw

    def command(self, max_jobs: int) -> tuple[object, ...]:
        args = list(self.args)
        args[MAX_JOBS_ARG] = max_jobs
        return ("EVALSHA", self.sha, len(self.keys), *self.keys, *args)


class QueueReader:
    def __init__(self, client: redis.Redis, settings: ServiceSettings, consumer: str) -> None:
        self.redis = client
        self.settings = settings
        self.consumer = consumer
        self.partitions = list(range(settings.redis_partitions))
        self.priority_order = PriorityOrder(settings.starvation_limit)
        self._pull = client.register_script(lua.PULL)
        self._requeue = client.register_script(lua.REQUEUE)
        # the loop's pulls and idle waits go out on a connection it holds (shared/redis_url.py); a Cluster routes
        # each command by its slot instead
        self._held = None if isinstance(client, redis.cluster.RedisCluster) else redis_urls.HeldConnection(client)
        self._contexts = lua.contexts(settings.events_maxlen, settings.result_ttl_s, settings.redis_partitions)
        self._expired = _error_json(
            JobStatus.EXPIRED, ErrorCode.EXPIRED, "the job's ttl_s passed before it started"
        )
        self._dead = _error_json(
            JobStatus.FAILED,
            ErrorCode.MAX_DELIVERIES,
            f"the job was started {settings.max_deliveries} times and its worker died each time",
        )
        self._last_reclaim_s = -float("inf")
        self._first_partition = 0  # where the next pull starts within a priority (rotates: fairness)
        self._next_block_partition = 0  # Cluster: the partition the next idle wait blocks on
        # newest entry seen per stream by the last pulls
        self.last_ids: dict[Stream, str] = {(n, p): "0-0" for n in self.partitions for p in Priority}
        self.waiting = {p: False for p in Priority}  # entries left undelivered by the last pull, any partition
        self._pull_call: PullCall | None = None  # pull_call()'s answer until a pull changes what it holds

    def ensure_groups(self) -> None:
        for partition in self.partitions:
            for priority in Priority:
                try:
                    self.redis.xgroup_create(
                        keys.queue_stream(priority, partition), keys.CONSUMER_GROUP, id="0", mkstream=True
                    )
                except ResponseError as exc:
                    if "BUSYGROUP" not in str(exc):
                        raise

    def pull(self, max_jobs: int, priorities: list[Priority] | None = None) -> list[Lease]:
        """Start and return up to `max_jobs` jobs (expired, cancelled and dead ones are settled on the way),
        from the queues of `priorities` only when given (a full engine that would preempt for them); such a
        pull reclaims nothing, and leaves the other queues' `waiting` as the last full pull saw them."""
        if max_jobs <= 0:
            return []
        reclaim_ms = self._reclaim_ms() if priorities is None else "0"
        order = [p for p in self.priority_order.order() if priorities is None or p in priorities]
        if len(self.partitions) == 1:  # one call reads the streams in priority order (one round trip)
            return self._record(*self._call(0, order, max_jobs, reclaim_ms))
        num = len(self.partitions)
        rotation = [self.partitions[(self._first_partition + i) % num] for i in range(num)]
        self._first_partition = (self._first_partition + 1) % num
        leases: list[Lease] = []
        waiting = {p: False for p in order}
        unvisited: dict[int, list[Priority]] = {}
        for priority in order:
            for partition in rotation:
                if len(leases) >= max_jobs:
                    unvisited.setdefault(partition, []).append(priority)
                    continue
                taken, left = self._call(partition, [priority], max_jobs - len(leases), reclaim_ms)
                leases += taken
                waiting[priority] = waiting[priority] or left[priority]
        for priority, left_now in self._look(unvisited).items():
            waiting[priority] = waiting[priority] or left_now
        return self._record(leases, waiting)

    def unseen(self, announced: dict[Priority, str | None]) -> set[Priority]:
        """The queues of announced jobs (control.py) that the last pulls did not see: an entry newer than the
        newest one the last pull saw on its stream, or an announcement without its entry. Every announced queue
        with several partitions (an announcement names no partition). A job a pull saw but left waiting is
        still pulled: `waiting` says so."""
        if len(self.partitions) != 1:
            return set(announced)
        return set(unseen_entries(announced, {p: self.last_ids[(0, p)] for p in announced}))

    def _reclaim_ms(self) -> str:
        """The PULL's reclaim argument: idle entries of other consumers older than claim_timeout_s are taken over
        when reclaim_interval_s has passed since the last reclaim, else none ("0")."""
        if time.monotonic() - self._last_reclaim_s < self.settings.reclaim_interval_s:
            return "0"
        self._last_reclaim_s = time.monotonic()
        return str(int(self.settings.claim_timeout_s * 1000))

    def pull_call(self) -> PullCall | None:
        """The PULL that another connection may send for this reader (it reclaims nothing: the loop's own pulls
        do), or None where one call cannot cover every queue (several partitions, a Cluster). Built again only
        after a pull changed its order or the entries it names as seen."""
        if self._held is None or len(self.partitions) != 1:
            return None
        if self._pull_call is None:
            order = self.priority_order.order()
            self._pull_call = PullCall(
                order=order,
                sha=self._pull.sha,
                keys=[keys.queue_stream(p, 0) for p in order],
                args=self._args(0, 0, "0"),
                last_ids={p: self.last_ids[(0, p)] for p in Priority},
            )
        return self._pull_call

    def read_pulled(self, call: PullCall, reply: Any) -> list[Lease] | None:
        """The jobs a PullCall's reply started, read as this reader's own pull's -> None where Redis refused it
        because it lost the script or the streams (the reader's next own pull loads or makes them again)."""
        if isinstance(reply, NoScriptError) or (isinstance(reply, ResponseError) and "NOGROUP" in str(reply)):
            return None
        if isinstance(reply, Exception):
            raise reply
        return self._record(*self._read_reply(0, call.order, reply))

    def _record(self, leases: list[Lease], waiting: dict[Priority, bool]) -> list[Lease]:
        self._pull_call = None
        self.waiting.update(waiting)
        self.priority_order.record([lease.priority for lease in leases], self.waiting)
        return leases

    def _args(self, partition: int, max_jobs: int, reclaim_ms: str) -> list[str | int]:
        return [
            self._contexts[partition],
            self.consumer,
            max_jobs,
            reclaim_ms,
            self.settings.max_deliveries,
            *self._expired,
            *self._dead,
            keys.dead_letter_stream(partition),
            keys.DEAD_LETTER_MAXLEN,
            self.settings.model_version,
        ]

    def _call(
        self, partition: int, order: list[Priority], max_jobs: int, reclaim_ms: str
    ) -> tuple[list[Lease], dict[Priority, bool]]:
        """One PULL call on `order`'s streams of one partition -> (leases, whether entries wait per priority)."""
        call_keys = [keys.queue_stream(p, partition) for p in order]
        call_args = self._args(partition, max_jobs, reclaim_ms)
        try:
            reply = self._run_pull(call_keys, call_args)
        except ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            self.ensure_groups()  # the streams were deleted under us (a flushed or replaced Redis)
            reply = self._run_pull(call_keys, call_args)
        return self._read_reply(partition, order, reply)

    def _run_pull(self, call_keys: list[str], call_args: list[str | int]) -> Any:
        """One PULL call, on the held connection when there is one (a Redis that lost its scripts gets it again)."""
        if self._held is None:
            return self._pull(keys=call_keys, args=call_args)
        arguments = (len(call_keys), *call_keys, *call_args)
        reply = self._held.execute([("EVALSHA", self._pull.sha, *arguments)])[0]
        if isinstance(reply, NoScriptError):
            self._pull.sha = self.redis.script_load(lua.PULL)
            reply = self._held.execute([("EVALSHA", self._pull.sha, *arguments)])[0]
        if isinstance(reply, Exception):
            raise reply
        return reply

    def _look(self, streams: dict[int, list[Priority]]) -> dict[Priority, bool]:
        """Whether entries wait on these streams (PULL with n = 0: nothing taken), every partition pipelined."""
        if not streams:
            return {}
        pipes = redis_urls.PartitionPipelines(self.redis)
        calls = []
        for partition, order in streams.items():
            pipe = pipes.of(partition)
            calls.append((partition, order, pipe, len(pipe)))
            self._pull(keys=[keys.queue_stream(p, partition) for p in order],
                       args=self._args(partition, 0, "0"), client=pipe)  # fmt: skip
        try:
            replies = pipes.execute()
        except ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            self.ensure_groups()  # the next pull finds the streams
            return {}
        waiting = {p: False for order in streams.values() for p in order}
        for partition, order, pipe, index in calls:
            _, left = self._read_reply(partition, order, replies[id(pipe)][index])
            for priority, left_now in left.items():
                waiting[priority] = waiting[priority] or left_now
        return waiting

    def _read_reply(
        self, partition: int, order: list[Priority], reply: Any
    ) -> tuple[list[Lease], dict[Priority, bool]]:
        started, waiting, last_ids = reply
        self._pull_call = None
        self.last_ids.update(zip([(partition, p) for p in order], last_ids, strict=True))
        leases = [self._lease(order, row) for row in started]
        return leases, {p: bool(w) for p, w in zip(order, waiting, strict=True)}

    @staticmethod
    def _lease(order: list[Priority], row: list[Any]) -> Lease:
        job_id, entry_id, stream_index, attempt, raw_request, text, token_ids, *times = row
        request: JobRequest | StoredRequestError
        try:
            request = stored_request(raw_request)
        except StoredRequestError as exc:  # the worker fails this job and goes on (never a crash on a pull)
            request = exc
        return Lease(
            job_id=job_id,
            entry_id=entry_id,
            priority=order[int(stream_index) - 1],
            attempt=int(attempt),
            request=request,
            resumed_text=text,
            resumed_token_ids=parse_token_ids(token_ids),
            clock=JobClock.of(*times),
        )

    def wait_and_pull(self, block_ms: int, max_jobs: int) -> list[Lease] | None:
        """wait_for_jobs, and the pull(max_jobs) that follows it, in one round trip: one write carries the blocking
        XREAD and a PULL call behind it, which Redis runs as soon as the XREAD answers (a job came, or block_ms
        passed), before this process has even woken. A job submitted to an idle worker so starts one round trip
        and one wake-up of the worker sooner. -> the jobs started, or None where this only waited (a Cluster or
        several partitions: one PULL cannot cover them; nothing to take): the caller then pulls as usual.
        A PULL that Redis refused (its script or its streams lost) is sent again the usual way."""
        if self._held is None or len(self.partitions) != 1 or max_jobs <= 0:
            self.wait_for_jobs(block_ms)
            return None
        order = self.priority_order.order()
        streams = {keys.queue_stream(p, 0): self.last_ids[(0, p)] for p in Priority}
        call_keys = [keys.queue_stream(p, 0) for p in order]
        woke, pulled = self._held.execute([
            _blocking_read(streams, block_ms),
            ("EVALSHA", self._pull.sha, len(call_keys), *call_keys, *self._args(0, max_jobs, self._reclaim_ms())),
        ])  # fmt: skip
        if isinstance(woke, Exception):
            raise woke
        if isinstance(pulled, NoScriptError) or (isinstance(pulled, ResponseError) and "NOGROUP" in str(pulled)):
            return self.pull(max_jobs)  # loads the script, or makes the consumer groups, and calls it again
        if isinstance(pulled, Exception):
            raise pulled
        return self._record(*self._read_reply(0, order, pulled))

    def wait_for_jobs(self, block_ms: int) -> None:
        """Block until an entry newer than the last seen one lands on any queue stream, or block_ms pass. On a
        Cluster one XREAD cannot span partitions (their hash tags): it blocks on one partition's streams, the
        next one each call, for block_ms / N (a job queued elsewhere meanwhile waits at most the rest of the
        block; the queued channel and the periodic pull catch it too)."""
        if isinstance(self.redis, redis.cluster.RedisCluster) and len(self.partitions) > 1:
            partition = self._next_block_partition
            self._next_block_partition = (partition + 1) % len(self.partitions)
            streams = {keys.queue_stream(p, partition): self.last_ids[(partition, p)] for p in Priority}
            block_ms = max(1, block_ms // len(self.partitions))
        else:
            streams = {keys.queue_stream(p, n): self.last_ids[(n, p)] for n in self.partitions for p in Priority}
        if self._held is None:
            self.redis.xread(streams, count=1, block=block_ms)  # type: ignore[arg-type]
            return
        reply = self._held.execute([_blocking_read(streams, block_ms)])
        if isinstance(reply[0], Exception):
            raise reply[0]

    def close(self) -> None:
        """Give the held connection back to the client's pool."""
        if self._held is not None:
            self._held.close()

    def hand_back(self, lease: Lease) -> str:
        """Put a held job back at the tail of its queue (not counted as a delivery) -> 'ok' | 'gone' | 'lost'."""
        result = self._requeue(
            keys=[
                keys.job_hash(lease.job_id),
                keys.job_events(lease.job_id),
                keys.queue_stream(lease.priority, lease.partition),
            ],
            args=[self._contexts[lease.partition], lease.job_id, lease.attempt],
        )
        return str(result)


def _blocking_read(streams: dict[str, str], block_ms: int) -> tuple[object, ...]:
    """The XREAD an idle worker blocks in: one entry newer than the last seen one on any of `streams`."""
    return ("XREAD", "COUNT", 1, "BLOCK", block_ms, "STREAMS", *streams, *streams.values())
