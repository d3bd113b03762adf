"""Channel: the loop's end of a socket pair reads what the child's multiprocessing Connection sends (its
framing), every whole message that has arrived per read, in order; a read with nothing there returns at once;
a child that closed its end reads as EOF only after its last messages were taken. Real sockets, a real child
process for the round trip."""

import pickle
import socket
import struct
import threading
from collections.abc import Iterator
from multiprocessing.connection import Connection

import pytest

from workers.child_process import Channel, spawn_connected

ECHO = "from multiprocessing.connection import Connection as C; c = C({fd})\nwhile (m := c.recv()) is not None: c.send(m)"


@pytest.fixture
def pair() -> Iterator[tuple[Channel, Connection]]:
    ours, theirs = socket.socketpair()
    channel, conn = Channel(ours.detach()), Connection(theirs.detach())
    yield channel, conn
    channel.close()
    conn.close()


def test_every_message_that_arrived_in_order(pair: tuple[Channel, Connection]) -> None:
    channel, conn = pair
    messages = [("step", i, "x" * i) for i in range(50)] + [b"y" * 300_000, {"big": list(range(20_000))}]
    sender = threading.Thread(target=lambda: [conn.send(m) for m in messages])  # more than a socket buffer holds
    sender.start()
    taken: list[object] = []
    while len(taken) < len(messages):
        taken += channel.read(10.0)  # a read takes what arrived: many small ones at once, a big one over recvs
    sender.join()
    assert taken == messages


def test_nothing_there_returns_at_once_and_a_wait_ends_with_the_message(pair: tuple[Channel, Connection]) -> None:
    channel, conn = pair
    assert channel.read(0.0) == []
    assert channel.read(0.05) == []  # waits, then nothing
    threading.Timer(0.1, conn.send, [("late", 1)]).start()
    assert channel.read(None) == [("late", 1)]  # no limit: until it came


def test_a_partial_message_waits_for_its_rest() -> None:
    ours, theirs = socket.socketpair()
    channel = Channel(ours.detach())
    try:
        data = pickle.dumps(("half", "and half"))
        frame = struct.pack("!i", len(data)) + data
        theirs.sendall(frame[:7])  # the length and a few bytes
        assert channel.read(0.0) == []
        theirs.sendall(frame[7:])
        assert channel.read(1.0) == [("half", "and half")]
    finally:
        channel.close()
        theirs.close()


def test_eof_only_after_the_last_messages(pair: tuple[Channel, Connection]) -> None:
    channel, conn = pair
    conn.send("last words")
    conn.close()
    assert channel.read(1.0) == ["last words"]
    with pytest.raises(EOFError):
        channel.read(1.0)


def test_round_trip_with_a_child_process() -> None:
    child, conn = spawn_connected(lambda fd: ["-c", ECHO.format(fd=fd)])
    channel = Channel.of(conn)
    try:
        sent = [("step", i, tuple(range(i))) for i in range(20)]
        for message in sent:
            channel.send(message)
        echoed: list[object] = []
        while len(echoed) < len(sent):
            echoed += channel.read(10.0)
        assert echoed == sent
        channel.send(None)
        assert child.wait(10) == 0
    finally:
        channel.close()
        if child.poll() is None:
            child.kill()
