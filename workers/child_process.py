"""A Python child process of the worker's, holding one end of a private socket pair: the worker's step writer
(workers/worker/writer.py) and the tensor-parallel ranks (workers/engine/tp_group.py).

The child is a fresh interpreter (`python -c` or `python -m`, not multiprocessing: nothing of the caller's
__main__ is re-imported), started in the repository root so it imports this checkout's code, and given the
file descriptor of its end. The caller's end is a multiprocessing Connection (pickled messages, each framed by
its length). Only the child holds its end, so a child that exits reads as EOF / a broken pipe here.
"""

import socket
import subprocess
import sys
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the repository root: children import the worker's code from here


def spawn_connected(args_of: Callable[[int], list[str]]) -> tuple[subprocess.Popen[bytes], Connection]:
    """Start `python *args_of(fd)` where fd is the child's end of a new socket pair; (the child, our end)."""
    ours, theirs = socket.socketpair()
    try:
        child = subprocess.Popen([sys.executable, *args_of(theirs.fileno())], pass_fds=(theirs.fileno(),), cwd=ROOT)
    except OSError:
        ours.close()
        raise
    finally:
        theirs.close()  # the child holds its own copy
    return child, Connection(ours.detach())
