"""A `specfleet worker --tensor-parallel-size 2` process (rank 0 + one spawned rank) with a real Redis and gateway:
a real SIGKILL of its rank takes the worker down (non-zero exit, no hang), its job goes back to the queue and
another TP = 2 worker finishes it with the uninterrupted output; a SIGKILL of rank 0 leaves no orphan rank and
no orphan writer process."""

import os
import signal
import subprocess
import sys
from functools import partial
from pathlib import Path

import redis

from shared import keys
from shared.client import FleetClient
from tests.helpers.gateway import ThreadedGateway
from tests.helpers.waiting import job_finished, wait_until
from tests.workers.worker.test_worker_e2e import WORKER_ENV

ROOT = Path(__file__).resolve().parents[3]
LONG = {"prompt": "def f(x):", "max_tokens": 160, "temperature": 0, "ignore_eos": True}


def spawn_worker(name: str, redis_url: str, tiny_pair: tuple[Path, Path], log_dir: Path) -> subprocess.Popen[bytes]:
    target, draft = tiny_pair
    args = [
        sys.executable, "-m", "shared.cli", "worker", "--target", str(target), "--draft", str(draft),
        "--name", name, "--max-num-seqs", "2", "--num-threads", "1", "--tensor-parallel-size", "2",
    ]  # fmt: skip
    env = {**os.environ, **WORKER_ENV, "REDIS_URL": redis_url}
    with open(log_dir / f"{name}.log", "wb") as log:
        return subprocess.Popen(args, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)


def wait_ready(client: redis.Redis, name: str) -> None:
    wait_until(lambda: client.zscore(keys.WORKERS_ZSET, name) is not None, timeout_s=180, interval_s=0.05,
               what=f"worker {name} to heartbeat")


def children_of(pid: int) -> list[int]:
    """Live processes whose parent is `pid` (from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid and fields[0] != "Z":
                found.append(int(entry.name))
    return found


def ranks_of(pid: int) -> list[int]:
    """The worker's tensor-parallel ranks (its other child is its writer process)."""
    return [p for p in children_of(pid) if b"workers.engine.tp_rank" in (Path("/proc") / str(p) / "cmdline").read_bytes()]


def is_gone(pid: int) -> bool:
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


finished = partial(job_finished, timeout_s=180, interval_s=0.05)


def test_a_killed_rank_takes_the_worker_down_and_its_job_is_finished_elsewhere(
    gateway: ThreadedGateway, redis_url: str, rclient: redis.Redis, tiny_pair: tuple[Path, Path], tmp_path: Path
) -> None:
    first = spawn_worker("tp-a", redis_url, tiny_pair, tmp_path)
    second: subprocess.Popen[bytes] | None = None
    try:
        wait_ready(rclient, "tp-a")
        ranks = ranks_of(first.pid)
        assert len(ranks) == 1 and len(children_of(first.pid)) == 2  # rank 1 (rank 0 is the worker), the writer
        with FleetClient(gateway.url) as fleet:
            job_id = fleet.submit(LONG)["id"]
            wait_until(lambda: fleet.get(job_id)["usage"]["completion_tokens"] > 0, timeout_s=120,
                       interval_s=0.005, what="the job to produce tokens")
            os.kill(ranks[0], signal.SIGKILL)
            assert first.wait(timeout=120) != 0  # down, not hanging
            assert "tensor-parallel rank 1" in (tmp_path / "tp-a.log").read_text()

            second = spawn_worker("tp-b", redis_url, tiny_pair, tmp_path)
            job = finished(fleet, job_id)
            assert job["status"] == "succeeded" and len(job["output"]["token_ids"]) == LONG["max_tokens"]
            assert rclient.hget(keys.job_hash(job_id), "worker") == "tp-b"
            reference = finished(fleet, fleet.submit(LONG)["id"])  # the same greedy job, uninterrupted
            assert job["output"]["token_ids"] == reference["output"]["token_ids"]

        second_children = children_of(second.pid)  # rank 1 and the writer process
        second.kill()  # rank 0 SIGKILLed: its rank and its writer see their sockets close and exit by themselves
        second.wait(timeout=60)
        wait_until(lambda: all(map(is_gone, second_children)), timeout_s=60, what="rank 1 and the writer to exit")
        assert len(second_children) == 2 and all(map(is_gone, ranks))
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(timeout=60)
