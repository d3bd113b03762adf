"""The cores a process or thread may run on, as the kernel reports them (/proc): the CPU placement tests."""

from pathlib import Path

import pytest

from shared import cpu_placement

ALLOWED = cpu_placement.allowed_cpus()  # this test process's cores
needs_two_cores = pytest.mark.skipif(len(ALLOWED) < 2, reason="binding apart needs two allowed cores")


def cores_of(pid: int, tid: int | None = None) -> frozenset[int]:
    """Cpus_allowed_list of a process (its main thread), or of its thread `tid`."""
    path = Path(f"/proc/{pid}/task/{tid}/status") if tid else Path(f"/proc/{pid}/status")
    line = next(row for row in path.read_text().splitlines() if row.startswith("Cpus_allowed_list:"))
    return cpu_placement.parse_cpu_list(line.split(":", 1)[1].strip())


def threads_of(pid: int) -> list[int]:
    return [int(task.name) for task in Path(f"/proc/{pid}/task").iterdir()]
