"""Waiting on a condition instead of sleeping and hoping."""

import socket
import time

from shared.client import FleetClient


def wait_until(condition, timeout_s: float = 10.0, interval_s: float = 0.01, what: str = "condition"):  # noqa: ANN001, ANN201
    """Poll `condition()` until it returns something truthy (returned), failing after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(interval_s)


def job_finished(fleet: FleetClient, job_id: str, timeout_s: float = 60, interval_s: float = 0.02) -> dict:
    """The job's record (GET /v1/jobs/{id}) once it has left queued and running."""
    return wait_until(
        lambda: (job := fleet.get(job_id))["status"] not in ("queued", "running") and job,
        timeout_s=timeout_s,
        interval_s=interval_s,
        what=f"job {job_id} to finish",
    )


def peeked(sock: socket.socket, text: bytes) -> bool:
    """Whether `text` waits in `sock`'s receive queue (nothing is read from it)."""
    try:
        return text in sock.recv(1 << 16, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except BlockingIOError:
        return False
