"""Child-process helpers shared by `specfleet up`, the Redis launcher and the tests: no orphans."""

import ctypes
import signal
import sys
from typing import Self

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """preexec_fn: the child gets SIGTERM when its parent dies, even by SIGKILL (Linux; elsewhere a no-op)."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


class ProcessGroup:
    """`with Group(...) as group:` for what starts several processes: `start()` on entry (and `stop()` when the
    start fails half-way, so no process outlives it), `stop()` on exit. Subclasses define both."""

    def start(self) -> Self:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()
