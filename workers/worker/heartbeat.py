"""Liveness, on a thread of its own so a long engine step never delays it.

Every `heartbeat_interval_s`: mark this worker alive (keys.WORKERS_ZSET, read by /readyz) and reset the
idle time of every held job's queue entry (HEARTBEAT script: XCLAIM ... JUSTID, only while this worker's
attempt is the current one), so no other worker reclaims a job that is alive. One pipeline per partition node
(shared/redis_url.py PartitionPipelines: one in all off a Cluster). Jobs found to be no longer
ours (cancelled, reclaimed) are reported to the main loop through `take_lost()`.
"""

import logging
import threading
import time
from collections.abc import Callable

import redis

from shared import cpu_placement, keys, lua
from shared import redis_url as redis_urls
from shared.settings import ServiceSettings
from workers.worker.queue_reader import Lease

log = logging.getLogger(__name__)


class Heartbeat(threading.Thread):
    def __init__(
        self,
        client: redis.Redis,
        settings: ServiceSettings,
        worker_id: str,
        held: Callable[[], list[Lease]],
        model_info: dict[str, str] | None = None,
        cpus: frozenset[int] = frozenset(),  # the thread runs there (shared/cpu_placement.py); empty: anywhere
    ) -> None:
        super().__init__(name="heartbeat", daemon=True)
        self.redis = client
        self.interval_s = settings.heartbeat_interval_s
        self.worker_id = worker_id
        self.held = held
        self.model_info = (
            model_info  # republished on each beat: max_model_len, tokenizer_path (gateway's 413)
        )
        self._contexts = lua.contexts(settings.events_maxlen, settings.result_ttl_s, settings.redis_partitions)
        self._script = client.register_script(lua.HEARTBEAT)
        self.cpus = cpus
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._lost: set[str] = set()

    def beat(self) -> None:
        """One heartbeat (also called directly by tests)."""
        leases = self.held()
        pipes = redis_urls.PartitionPipelines(self.redis)
        pipe = pipes.of(0)  # the global keys live in partition 0
        pipe.zadd(keys.WORKERS_ZSET, {self.worker_id: time.time()})
        if self.model_info:
            pipe.hset(keys.MODEL_INFO, mapping=self.model_info)  # type: ignore[arg-type]
        at = []  # per lease: (its pipeline, the index of its reply there)
        for lease in leases:
            pipe = pipes.of(lease.partition)
            at.append((pipe, len(pipe)))
            self._script(
                keys=[keys.job_hash(lease.job_id), keys.queue_stream(lease.priority, lease.partition)],
                args=[self._contexts[lease.partition], self.worker_id, lease.attempt],
                client=pipe,
            )
        replies = pipes.execute()
        results = [replies[id(pipe)][index] for pipe, index in at]
        lost = {lease.job_id for lease, result in zip(leases, results, strict=True) if result != "ok"}
        if lost:
            with self._lock:
                self._lost |= lost

    def take_lost(self) -> set[str]:
        with self._lock:
            lost, self._lost = self._lost, set()
        return lost

    def run(self) -> None:
        cpu_placement.bind(self.cpus)  # this thread only: off the engine's cores
        while not self._stopping.wait(self.interval_s):
            try:
                self.beat()
            except redis.RedisError as exc:
                log.warning("heartbeat failed: %s", exc)

    def stop(self) -> None:
        self._stopping.set()
        if self.is_alive():
            self.join()
        try:
            self.redis.zrem(keys.WORKERS_ZSET, self.worker_id)
        except redis.RedisError as exc:
            log.warning("could not unregister worker %s: %s", self.worker_id, exc)
