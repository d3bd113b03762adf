"""The worker's control channels on a real Redis: cancels and "a job was queued" come back from take(), all of
a burst in one take, none when nothing was published, each seen from the socket alone (no full check of
redis-py's) even behind the messages redis-py drops; after Redis drops the subscription's connection, take()
raises (the loop's warning path) or reconnects, and messages published after that arrive."""

from collections.abc import Callable, Iterator

import pytest
import redis

from shared import keys
from shared.schemas import Priority
from shared.settings import ServiceSettings
from tests.helpers.redis_fixtures import submit_job
from tests.helpers.waiting import wait_until
from workers.worker.control import ControlChannel, ControlMessages


@pytest.fixture
def control(rclient: redis.Redis) -> Iterator[ControlChannel]:
    channel = ControlChannel(rclient)
    channel.subscribe()
    wait_until(lambda: rclient.pubsub_numsub(keys.CANCEL_CHANNEL)[0][1] == 1, timeout_s=5, what="the subscription")
    yield channel
    channel.close()


def _take(control: ControlChannel) -> ControlMessages:
    """take() as the worker's loop calls it: a RedisError is logged there and the next step tries again."""
    try:
        return control.take()
    except redis.RedisError:
        return ControlMessages()


def _take_until(control: ControlChannel, done: Callable[[ControlMessages], bool]) -> ControlMessages:
    taken = ControlMessages()

    def more() -> bool:
        got = _take(control)
        taken.cancelled |= got.cancelled
        taken.add_queued(got.queued)
        return done(taken)

    wait_until(more, timeout_s=5, interval_s=0.001, what="the messages")
    return taken


def test_cancels_and_queued_jobs_come_back(control: ControlChannel, rclient: redis.Redis) -> None:
    assert control.take() == ControlMessages()
    for i in range(20):
        rclient.publish(keys.CANCEL_CHANNEL, f"job-{i}")
    rclient.publish(keys.QUEUED_CHANNEL, Priority.BATCH.value)
    rclient.publish(keys.QUEUED_CHANNEL, "not a priority")  # names none: every queue, no entry known
    taken = _take_until(control, lambda t: len(t.cancelled) == 20 and t.queued == dict.fromkeys(Priority))
    assert taken.cancelled == {f"job-{i}" for i in range(20)}
    assert control.take() == ControlMessages()  # drained: nothing more


def test_a_submit_announces_its_queue_entry_and_the_newest_one_is_kept(
    control: ControlChannel, rclient: redis.Redis, settings: ServiceSettings
) -> None:
    first, second = (submit_job(rclient, settings, priority="batch") for _ in range(2))
    entries = [rclient.hget(keys.job_hash(job_id), "entry") for job_id in (first, second)]
    taken = _take_until(control, lambda t: t.queued.get(Priority.BATCH) == entries[1])
    assert taken.queued == {Priority.BATCH: entries[1]}  # the SUBMIT script's "<priority> <entry>"
    rclient.publish(keys.QUEUED_CHANNEL, f"batch {entries[0]}")  # an older one keeps the newest
    rclient.publish(keys.QUEUED_CHANNEL, "default 12-x")  # not an entry id: the queue, no entry
    taken.add_queued(_take_until(control, lambda t: Priority.DEFAULT in t.queued).queued)
    assert taken.queued == {Priority.BATCH: entries[1], Priority.DEFAULT: None}
    taken.add_queued({Priority.BATCH: None})  # one without its entry: the queue counts whatever the pulls saw
    assert taken.queued[Priority.BATCH] is None


def test_each_message_is_seen_from_the_socket_alone(rclient: redis.Redis) -> None:
    """No full check after the first take: a cancel must come through the socket's poll, also when it was read
    into redis-py's buffer together with a message redis-py drops (the subscribe confirmations)."""
    for i in range(20):  # fresh subscriptions: the confirmations' timing varies
        control = ControlChannel(rclient, full_check_interval_s=float("inf"))
        try:
            control.subscribe()
            control.take()  # the full check: may take the first confirmation alone
            rclient.publish(keys.CANCEL_CHANNEL, f"job-{i}")
            assert _take_until(control, lambda t, i=i: f"job-{i}" in t.cancelled).cancelled == {f"job-{i}"}
        finally:
            control.close()


def test_a_dropped_subscription_comes_back(control: ControlChannel, rclient: redis.Redis) -> None:
    assert rclient.client_kill_filter(_type="pubsub") == 1
    # redis-py sees the closed socket on a take (raised there), reconnects and subscribes again on the next
    wait_until(lambda: _take(control) == ControlMessages() and rclient.pubsub_numsub(keys.CANCEL_CHANNEL)[0][1] == 1
               and rclient.client_list(_type="pubsub") != [], timeout_s=10, interval_s=0.01,
               what="the subscription to come back")  # fmt: skip
    rclient.publish(keys.CANCEL_CHANNEL, "job-after")
    assert _take_until(control, lambda t: "job-after" in t.cancelled).cancelled == {"job-after"}
