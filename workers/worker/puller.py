"""Pulling while the engine steps: a thread that starts announced jobs between two of the loop's boundaries.

    the loop, at a boundary:  take() -> the replies of the pulls since the last boundary: their jobs start now
                              ... -> arm(call, room, pull_now) (its own pull only to reclaim, to preempt, or
                              with the engine empty: Worker._puller_pulls)
    the thread:               a job announced on keys.QUEUED_CHANNEL, newer than what the pulls saw, while armed
                              with room left -> one PULL round trip (QueueReader.pull_call) on a connection of
                              its own -> the raw reply kept for the next take(); room -= the jobs it started

At 16 clients the loop found most new jobs announced at its boundary and pulled for them there: the engine
waited on Redis for that reply 6-7 % of the loop's time (a dev fleet, demo pair, 32-token jobs, 2026-12-07),
longer than the PULL's own 0.3 ms, as the STEP scripts of the writer queue before it. The thread pulls as the
announcement comes, while the engine computes: it waits on its sockets and the engine's native layers run in
ctypes calls, both without the GIL, so the thread's Python (a message's parse, the send, the reply's read) fits
in the engine's native time rather than adding to its step, and the reply is most often there when the step
ends. The loop parses the replies itself (QueueReader.read_pulled), so the reader's `last_ids`, `waiting` and
priority order stay the loop's alone.

The room it is armed with is the engine's free slots once the boundary's own admissions start (Engine.
room_after_waiting: none while the engine's last step left a request waiting); the loop admits nothing else
while it is armed. take() disarms it, except while a pull is in flight: the loop does not wait for that reply
(at 16 clients a PULL from the thread took 0.8-0.9 ms p50, 2.3-2.8 p90, against engine steps of ~4 ms), the
thread stays armed, and a later boundary admits its jobs. Announcements that came while it was not armed wait in the
thread: arm() drops the ones its call's pulls already saw and pulls at once for the rest. An announcement the
loop's own control channel read first (the thread had not pulled for it by the boundary) or a pull that left
jobs waiting arms it with `pull_now`: those jobs start one step later rather than the whole batch waiting for a
pull. A Redis error of a pull is raised by the next take(), for the loop to handle as its own pull's.

Where it runs: beside the loop, on the engine's cores, not with the writer and the heartbeat on the I/O core
(shared/cpu_placement.py). At 16 clients on 2 cores that core also runs Redis, the gateway and the writer, and
is busy: a thread there woke late, so more announcements reached the loop first and more pulls were still in
flight at a boundary, and their jobs started a step later. The thread sleeps but for a few tens of microseconds
of Python a pull, which it takes from the engine. Measured side by side (dev fleets, demo pair, 320 jobs of 32
tokens at 16 clients, rounds alternated, 2026-12-07): on the I/O core 736 engine steps a round, TTFT p50 22.4
ms; on the engine's 706 steps, 17.1 ms; 3,190 against 3,301 tokens/s. Against the loop's own pulls (10
rounds each): the loop's time outside engine steps 9.8 % against 13.5 %, its pull part 0.089 against 0.222 s a
round, 701 against 685 steps (jobs that start a step later), tokens/s +2 % and +5 % in two series (rounds swung
+-10 % on this host: the loop's shares are the steadier measure).
"""

import logging
import os
import select
import threading
import time
from typing import Any

import redis
from redis.exceptions import NoScriptError

from shared import keys, lua
from shared import redis_url as redis_urls
from shared.schemas import Priority
from workers.worker.control import ControlMessages, queued_of
from workers.worker.queue_reader import PullCall, unseen_entries

log = logging.getLogger(__name__)

POLL_MS = 1000  # the thread wakes at least this often (its stop; redis-py's reconnects and health checks)
RETRY_S = 1.0  # after its subscription failed, the thread subscribes again this much later


class Puller(threading.Thread):
    def __init__(self, client: redis.Redis) -> None:
        super().__init__(name="puller", daemon=True)  # on the cores of the thread that starts it ("Where it runs")
        self._pubsub = client.pubsub(ignore_subscribe_messages=True)
        self._held = redis_urls.HeldConnection(client)  # the thread's own: the loop's pulls use the reader's
        self._wake_r, self._wake_w = os.pipe()  # arm() and stop() wake the thread's poll
        self._lock = threading.Lock()
        self._settled = threading.Condition(self._lock)  # a pull in flight ended
        self._call: PullCall | None = None  # armed with it; None: no pull starts
        self._room = 0  # jobs the engine admits that the armed thread has not started yet
        self._seen: dict[Priority, str] = {}  # newest entry per queue that the pulls saw (the call's, then its own)
        self._announced = ControlMessages()  # announcements not yet pulled for (or found seen)
        self._in_flight = False
        self._replies: list[tuple[PullCall, Any]] = []  # since the last take(), in order
        self._error: redis.RedisError | None = None
        self._stopping = False
        self._watching = True  # the thread polls the subscription (rest(): not while the engine is empty)
        self.num_pulls = 0  # round trips made (tests, metrics)

    def subscribe(self) -> None:
        """Before start(): announcements from now on reach the thread."""
        self._pubsub.subscribe(keys.QUEUED_CHANNEL)

    # -- the loop's side ------------------------------------------------------------------------------------
    def arm(self, call: PullCall, room: int, pull_now: bool = False) -> None:
        """Let the thread start up to `room` announced jobs with `call` until a take() disarms it; `pull_now`:
        jobs are known to wait (the loop read their announcements, or a pull left them): pull at once."""
        with self._lock:
            self._call, self._room, self._seen = call, room, dict(call.last_ids)
            self._announced.queued = unseen_entries(self._announced.queued, self._seen)
            if pull_now:
                self._announced.add_queued(dict.fromkeys(call.order))  # entries unnamed: never seen
            wake = bool(self._announced.queued) or not self._watching
            self._watching = True
        if wake:  # announced while it was not armed, or known to wait: pull now; or it rested: watch again
            os.write(self._wake_w, b"a")

    def rest(self) -> None:
        """Disarm, and stop watching the subscription until the next arm() (the engine is empty: the loop's idle
        wait pulls). One client's next job is announced as the idle wait's reply comes: a thread that woke for
        that announcement on the engine's core delayed the job's start (dev fleets, demo pair, one client, 100
        jobs a round, 8 rounds alternated each way, 2026-12-07: TTFT p50 +0.4-0.5 ms)."""
        with self._lock:
            self._call = None
            wake = self._watching
            self._watching = False
        if wake:
            os.write(self._wake_w, b"r")

    def take(self, wait: bool = False) -> tuple[list[tuple[PullCall, Any]], bool]:
        """-> the replies of the pulls made since the last take() (each with its call), and whether a pull is in
        flight still: then the thread stays armed as it was (the loop admits nothing else until that one's reply
        came: it does not wait for it), else it is disarmed. `wait`: wait out a pull in flight first, and
        disarm. A pull's Redis error is raised here (once)."""
        with self._lock:
            if wait:
                self._call = None
                while self._in_flight:
                    self._settled.wait()
            in_flight = self._in_flight
            if not in_flight:
                self._call = None
            replies, self._replies = self._replies, []
            error, self._error = self._error, None
        if error is not None:
            raise error
        return replies, in_flight

    def stop(self) -> None:
        """End the thread (a pull in flight ends first); take() still gives what it pulled. Once only."""
        with self._lock:
            self._stopping = True
            self._call = None
        os.write(self._wake_w, b"s")
        if self.is_alive():
            self.join()
        self._pubsub.close()
        self._held.close()
        os.close(self._wake_r)
        os.close(self._wake_w)

    # -- the thread -----------------------------------------------------------------------------------------
    def run(self) -> None:
        """The thread's loop; a bug in it ends the thread (logged), and the worker's loop pulls for itself."""
        try:
            self._run()
        except Exception:
            log.exception("puller: the thread failed; the loop pulls for itself from now on")
        finally:
            with self._lock:
                self._call, self._in_flight = None, False
                self._settled.notify_all()

    def _run(self) -> None:
        poller = select.poll()
        poller.register(self._wake_r, select.POLLIN)
        fd = -1  # the subscription's socket registered in `poller` (redis-py opens another when it reconnects)
        while not self._stopping:
            try:
                sock = getattr(self._pubsub.connection, "_sock", None) if self._watching else None
                if (sock is None and fd >= 0) or (sock is not None and sock.fileno() != fd):
                    if fd >= 0:
                        poller.unregister(fd)
                    fd = -1
                    if sock is not None:
                        fd = sock.fileno()
                        poller.register(fd, select.POLLIN)
                for ready, _ in poller.poll(POLL_MS):
                    if ready == self._wake_r:
                        os.read(self._wake_r, 64)
                if self._watching:
                    self._read_announcements()
            except redis.RedisError as exc:
                log.warning("puller: its subscription failed (%s); the loop's pulls go on", exc)
                time.sleep(RETRY_S)
                if fd >= 0:  # its socket is gone: left registered, poll() would answer at once (POLLNVAL) for good
                    poller.unregister(fd)
                fd = -1
                continue
            self._pull_while_armed()

    def _read_announcements(self) -> None:
        """Every message redis-py has (a drain: see workers/worker/control.py)."""
        while True:
            message = self._pubsub.get_message(timeout=0.0)
            if message is None:
                connection = self._pubsub.connection
                if connection is None or not connection.can_read(timeout=0):
                    return
                continue
            with self._lock:
                self._announced.add_queued(queued_of(message["data"]))

    def _pull_while_armed(self) -> None:
        """Pull for announcements the pulls have not seen, while armed with room."""
        while True:
            with self._lock:
                call = self._call
                if call is None or self._stopping:
                    return
                self._announced.queued = unseen_entries(self._announced.queued, self._seen)
                if self._room <= 0 or not self._announced.queued:
                    return
                self._announced.queued = {}
                self._in_flight = True
                room = self._room
            reply: Any = None
            error: redis.RedisError | None = None
            try:
                reply = self._held.execute([call.command(room)])[0]
                if isinstance(reply, NoScriptError):  # a Redis new or restarted: load the script, send it again
                    self._held.execute([("SCRIPT", "LOAD", lua.PULL)])
                    reply = self._held.execute([call.command(room)])[0]
            except redis.RedisError as exc:
                error = exc  # a bug instead ends the thread: run() clears the pull in flight for take()
            with self._lock:
                self._in_flight = False
                self.num_pulls += 1
                if error is not None:
                    self._error, self._call = error, None
                else:
                    self._replies.append((call, reply))
                    if isinstance(reply, Exception):  # refused (the script or the streams lost): the loop pulls
                        self._call = None
                    else:
                        started, _, last_ids = reply
                        self._room -= len(started)
                        self._seen.update(zip(call.order, last_ids, strict=True))
                self._settled.notify_all()
