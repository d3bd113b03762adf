"""Waiting on a condition instead of sleeping and hoping."""

import time


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
