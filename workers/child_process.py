"""A Python child process of the worker's, holding one end of a private socket pair: the worker's step writer
(workers/worker/writer.py) and the tensor-parallel ranks (workers/engine/tp_group.py).

The child is a fresh interpreter (`python -c` or `python -m`, not multiprocessing: nothing of the caller's
__main__ is re-imported), started in the repository root so it imports this checkout's code, and given the
file descriptor of its end. The caller's end is a multiprocessing Connection (pickled messages, each framed by
its length), or a Channel (below) that reads the same frames with fewer system calls. Only the child holds its
end, so a child that exits reads as EOF / a broken pipe here.
"""

import math
import os
import pickle
import select
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]  # the repository root: children import the worker's code from here
_HEADER = struct.Struct("!i")  # a message's length, as multiprocessing Connection frames it
_RECV_BYTES = 1 << 16  # read at most this much a call (more: the next call of the same read)


def spawn_connected(
    args_of: Callable[[int], list[str]], extra_fds: tuple[int, ...] = ()
) -> tuple[subprocess.Popen[bytes], Connection]:
    """Start `python *args_of(fd)` where fd is the child's end of a new socket pair; (the child, our end).
    `extra_fds`: more descriptors the child inherits (its arguments name them)."""
    ours, theirs = socket.socketpair()
    try:
        child = subprocess.Popen([sys.executable, *args_of(theirs.fileno())], pass_fds=(theirs.fileno(), *extra_fds),
                                 cwd=ROOT)  # fmt: skip
    except OSError:
        ours.close()
        raise
    finally:
        theirs.close()  # the child holds its own copy
    return child, Connection(ours.detach())


class Channel:
    """Our end of the socket pair, for a loop that reads its child's answers between engine steps: one `recv`
    system call takes every answer that has arrived (none: it returns at once).

    The framing is multiprocessing Connection's (a 4-byte big-endian length, then the pickle), so either end may
    be a Connection or a Channel (the step writer uses a Channel at both). Connection.recv costs a poll and two
    reads per message, each through its Python layers: right after an engine step had left the caches cold,
    ~30 us a step in the worker's loop (2026-12-04).
    """

    def __init__(self, fd: int) -> None:
        self._sock = socket.socket(fileno=fd)  # owns fd
        self._buffer = bytearray()  # bytes received, not yet taken as whole messages
        self._is_closed = False  # the child closed its end (read EOF)
        self._poller = select.poll()  # made once: a selector per wait costs more than the wait
        self._poller.register(fd, select.POLLIN)

    @classmethod
    def of(cls, conn: Connection) -> "Channel":
        """Take over `conn`'s socket (conn is closed)."""
        fd = os.dup(conn.fileno())
        conn.close()
        return cls(fd)

    def send(self, message: object) -> None:
        """Pickle `message` (the C pickler, protocol 5) and write it whole; OSError once the child is gone."""
        data = pickle.dumps(message, pickle.HIGHEST_PROTOCOL)
        self._sock.sendall(_HEADER.pack(len(data)) + data)

    def read(self, timeout_s: float | None = 0.0) -> list[Any]:
        """Every whole message that has arrived, waiting up to `timeout_s` (None: no limit) for the first; []
        when none came. EOFError once the child closed its end and every message before that was taken."""
        deadline_s = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            self._receive()
            messages = self._take()
            if messages:
                return messages
            if self._is_closed:
                raise EOFError("the child process closed its end")
            if deadline_s is None:
                self._poller.poll()
                continue
            left_s = deadline_s - time.monotonic()
            if left_s <= 0:
                return []
            self._poller.poll(math.ceil(left_s * 1e3))

    def close(self) -> None:
        self._sock.close()

    def _receive(self) -> None:
        """Append what has arrived, without waiting."""
        while not self._is_closed:
            try:
                chunk = self._sock.recv(_RECV_BYTES, socket.MSG_DONTWAIT)
            except BlockingIOError:
                return
            if not chunk:
                self._is_closed = True
                return
            self._buffer += chunk
            if len(chunk) < _RECV_BYTES:
                return

    def _take(self) -> list[Any]:
        """The whole messages at the front of the buffer, unpickled (a partial one stays)."""
        messages = []
        start = 0
        while len(self._buffer) - start >= _HEADER.size:
            (size,) = _HEADER.unpack_from(self._buffer, start)
            if size < 0:
                raise ValueError("a message of 2 GiB or more: Channel reads the short framing only")
            end = start + _HEADER.size + size
            if end > len(self._buffer):
                break
            messages.append(pickle.loads(self._buffer[start + _HEADER.size : end]))
            start = end
        if start:
            del self._buffer[:start]
        return messages
