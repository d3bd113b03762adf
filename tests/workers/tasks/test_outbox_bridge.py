"""The outbox bridge's thread on a real Redis: it reads its stream's notices through the consumer group, and makes
the group again when Redis lost it (a Redis that came back empty, a flush), instead of failing every read."""

import redis

from shared import keys
from shared.outbox import Notice, NoticeKind, notice_fields
from tests.helpers.waiting import wait_until
from workers.tasks.outbox import OutboxBridge, OutboxHandler


class Recorder(OutboxHandler):
    """The notices the bridge handed over, by id (what the handler does with them is tested elsewhere)."""

    def __init__(self) -> None:
        self.ids: list[str] = []

    def handle(self, notice: Notice) -> None:
        self.ids.append(notice.id)


def test_the_bridge_makes_its_group_again_after_redis_lost_it(rclient: redis.Redis) -> None:
    recorder = Recorder()
    bridge = OutboxBridge(rclient, recorder, "bridge-test")
    bridge.start()
    try:
        rclient.xadd(keys.OUTBOX_STREAM, notice_fields(NoticeKind.JOB, "first", "completed"))
        wait_until(lambda: recorder.ids == ["first"], timeout_s=10, what="the first notice")
        rclient.flushall()  # the stream and its consumer group are gone
        rclient.xadd(keys.OUTBOX_STREAM, notice_fields(NoticeKind.JOB, "second", "completed"))
        wait_until(lambda: recorder.ids == ["first", "second"], timeout_s=10, what="a notice after the flush")
        groups = rclient.xinfo_groups(keys.OUTBOX_STREAM)
        assert [g["name"] for g in groups] == [keys.OUTBOX_GROUP] and groups[0]["pending"] == 0
    finally:
        bridge.stop()
