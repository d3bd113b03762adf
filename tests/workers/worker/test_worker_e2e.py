"""End to end: real worker processes (tiny model pair) + a real gateway over HTTP + a real Redis."""

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from shared import keys
from shared.client import FleetClient
from shared.redis_server import RedisServer
from tests.helpers.gateway import ThreadedGateway
from tests.helpers.waiting import job_finished, wait_until

ROOT = Path(__file__).resolve().parents[3]
WORKER_ENV = {
    "SPECFLEET_HEARTBEAT_INTERVAL_S": "0.2",
    "SPECFLEET_CLAIM_TIMEOUT_S": "2",
    "SPECFLEET_RECLAIM_INTERVAL_S": "0.3",
    "SPECFLEET_IDLE_BLOCK_MS": "50",
    "SPECFLEET_SHUTDOWN_GRACE_S": "0",
}
LONG = {"prompt": "def f(x):", "max_tokens": 480, "temperature": 0, "ignore_eos": True}
SHORT = {"prompt": "import os", "max_tokens": 12, "temperature": 0}


class WorkerPool:
    """`specfleet worker` processes that live across the tests of this module (they survive FLUSHALL)."""

    def __init__(self, redis_url: str, tiny_pair: tuple[Path, Path], log_dir: Path) -> None:
        self.redis_url = redis_url
        self.target, self.draft = tiny_pair
        self.log_dir = log_dir
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.num_spawned = 0

    def spawn(self) -> str:
        self.num_spawned += 1
        name = f"w{self.num_spawned}"
        env = {**os.environ, **WORKER_ENV, "REDIS_URL": self.redis_url}
        args = [
            sys.executable,
            "-m",
            "shared.cli",
            "worker",
            "--target",
            str(self.target),
            "--draft",
            str(self.draft),
            "--name",
            name,
            "--max-num-seqs",
            "1",
            "--num-threads",
            "1",
        ]
        with open(self.log_dir / f"{name}.log", "wb") as log:
            self.procs[name] = subprocess.Popen(args, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        return name

    def ensure(self, count: int) -> list[str]:
        """At least `count` live workers, each heartbeating into the (freshly flushed) Redis."""
        for name, proc in list(self.procs.items()):
            if proc.poll() is not None:
                del self.procs[name]
        while len(self.procs) < count:
            self.spawn()
        client = redis.Redis.from_url(self.redis_url, decode_responses=True)
        try:
            for name in self.procs:
                wait_until(
                    lambda n=name: client.zscore(keys.WORKERS_ZSET, n) is not None,
                    timeout_s=120,
                    interval_s=0.05,
                    what=f"worker {name} to heartbeat",
                )
        finally:
            client.close()
        return list(self.procs)

    def stop_all(self) -> None:
        for proc in self.procs.values():
            proc.terminate()
        for proc in self.procs.values():
            proc.wait(timeout=30)


@pytest.fixture(scope="module")
def pool(
    redis_server: RedisServer, tiny_pair: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[WorkerPool]:
    workers = WorkerPool(redis_server.url, tiny_pair, tmp_path_factory.mktemp("worker-logs"))
    yield workers
    workers.stop_all()


@pytest.fixture
def fleet(pool: WorkerPool, gateway: ThreadedGateway) -> Iterator[FleetClient]:
    pool.ensure(2)
    with FleetClient(gateway.url) as client:
        yield client


def _running_with_tokens(client: FleetClient, job_id: str) -> dict:
    return wait_until(
        lambda: (job := client.get(job_id))["usage"]["completion_tokens"] > 0 and job,
        timeout_s=60,
        interval_s=0.005,
        what=f"job {job_id} to produce tokens",
    )


def test_submit_poll_and_stream_match(fleet: FleetClient) -> None:
    job_id = fleet.submit({**SHORT, "priority": "interactive"})["id"]
    events = list(fleet.stream(job_id))
    job = job_finished(fleet, job_id)
    assert job["status"] == "succeeded" and job["output"]["finish_reason"] in ("length", "stop")
    assert "".join(e.data["text"] for e in events if e.event == "token") == job["output"]["text"]
    assert [t for e in events if e.event == "token" for t in e.data["token_ids"]] == job["output"][
        "token_ids"
    ]
    assert events[-1].event == "done" and job["usage"]["completion_tokens"] == len(job["output"]["token_ids"])
    assert job["usage"]["prompt_tokens"] > 0 and job["metrics"]["ttft_ms"] > 0
    assert (
        job["metrics"]["acceptance_rate"] is not None
    )  # speculative by default (EngineConfig.speculative_method: draft; n-gram without a draft model)
    assert job["started_at"] >= job["created_at"] and job["completed_at"] >= job["started_at"]
    ready = fleet.http.get("/readyz")
    assert ready.status_code == 200 and ready.json()["workers_alive"] == 2


def test_prefer_wait_plain_decoding_and_413(fleet: FleetClient) -> None:
    plain = fleet.submit({**SHORT, "speculative": False}, wait_s=30)
    speculative = fleet.submit(SHORT, wait_s=30)
    assert plain["status"] == speculative["status"] == "succeeded"
    assert (
        plain["metrics"]["acceptance_rate"] is None and speculative["metrics"]["acceptance_rate"] is not None
    )
    assert plain["output"]["token_ids"] == speculative["output"]["token_ids"]  # greedy: the target's output
    too_long = fleet.http.post("/v1/jobs", json={"prompt": "x" * 600, "max_tokens": 4})
    assert too_long.status_code == 413  # the workers published max_model_len 512 and their tokenizer


def test_cancel_mid_generation_frees_capacity(fleet: FleetClient) -> None:
    first, second = (fleet.submit(LONG)["id"] for _ in range(2))
    waiting = fleet.submit(SHORT)["id"]
    running = _running_with_tokens(fleet, first)
    cancelled = fleet.cancel(first)
    assert cancelled["status"] == "cancelled"
    after = job_finished(fleet, waiting)
    assert after["status"] == "succeeded"
    other = job_finished(fleet, second)
    frozen = fleet.get(first)
    assert frozen["status"] == "cancelled" and frozen["error"]["code"] == "cancelled"
    assert frozen["usage"]["completion_tokens"] < LONG["max_tokens"]
    assert frozen["usage"]["completion_tokens"] <= cancelled["usage"]["completion_tokens"] + 32
    assert after["started_at"] < other["completed_at"]  # the cancelled job's slot was reused at once
    assert running["status"] == "running" and running["output"]["text"]  # partial output while running


def test_interactive_overtakes_queued_batch(fleet: FleetClient) -> None:
    blockers = [fleet.submit(LONG)["id"] for _ in range(2)]
    for blocker in blockers:
        _running_with_tokens(fleet, blocker)
    batch = [fleet.submit({**SHORT, "priority": "batch"})["id"] for _ in range(3)]
    interactive = fleet.submit({**SHORT, "priority": "interactive"})["id"]
    jobs = {job_id: job_finished(fleet, job_id) for job_id in [*batch, interactive, *blockers]}
    assert all(job["status"] == "succeeded" for job in jobs.values())
    assert all(jobs[interactive]["started_at"] < jobs[b]["started_at"] for b in batch)


def test_expired_job_never_starts(fleet: FleetClient, rclient: redis.Redis) -> None:
    blockers = [fleet.submit(LONG)["id"] for _ in range(2)]
    for blocker in blockers:
        _running_with_tokens(fleet, blocker)
    doomed = fleet.submit({**SHORT, "ttl_s": 0.05})
    expires_at = (
        doomed["expires_at"]
        if doomed.get("expires_at")
        else float(rclient.hget(keys.job_hash(doomed["id"]), "expires_at"))
    )
    wait_until(lambda: (t := rclient.time())[0] + t[1] / 1e6 > expires_at, what="the ttl to pass")
    for blocker in blockers:
        fleet.cancel(blocker)
    job = job_finished(fleet, doomed["id"])
    assert job["status"] == "expired" and job["started_at"] is None and job["error"]["code"] == "expired"
    events = list(fleet.stream(doomed["id"]))
    assert [e.event for e in events] == ["error"]


def test_two_workers_share_a_burst_and_finish_each_job_once(fleet: FleetClient, rclient: redis.Redis) -> None:
    job_ids = [fleet.submit(SHORT)["id"] for _ in range(12)]
    jobs = [job_finished(fleet, job_id) for job_id in job_ids]
    assert all(job["status"] == "succeeded" for job in jobs)
    holders = {rclient.hget(keys.job_hash(job_id), "worker") for job_id in job_ids}
    assert len(holders) == 2
    for job_id in job_ids:
        kinds = [fields["type"] for _, fields in rclient.xrange(keys.job_events(job_id))]
        assert kinds.count("done") == 1 and kinds.count("status") == 1
        assert rclient.hget(keys.job_hash(job_id), "attempt") == "1"
    assert rclient.xlen(keys.queue_stream("default")) == 0


def _interrupt_holder_and_let_the_other_finish(
    fleet: FleetClient, rclient: redis.Redis, pool: WorkerPool, sig: signal.Signals
) -> tuple[dict, str, str]:
    job_id = fleet.submit(LONG)["id"]
    _running_with_tokens(fleet, job_id)
    holder = rclient.hget(keys.job_hash(job_id), "worker")
    assert holder is not None
    pool.procs[holder].send_signal(sig)
    job = job_finished(fleet, job_id, timeout_s=90)
    return job, holder, rclient.hget(keys.job_hash(job_id), "worker") or ""


def test_sigterm_hands_the_job_back_and_another_finishes_it(
    fleet: FleetClient, rclient: redis.Redis, pool: WorkerPool
) -> None:
    job, holder, finisher = _interrupt_holder_and_let_the_other_finish(fleet, rclient, pool, signal.SIGTERM)
    assert pool.procs[holder].wait(timeout=30) == 0
    assert job["status"] == "succeeded" and finisher != holder
    assert job["usage"]["completion_tokens"] == LONG["max_tokens"] == len(job["output"]["token_ids"])
    streamed = list(fleet.stream(job["id"]))
    assert "".join(e.data["text"] for e in streamed if e.event == "token") == job["output"]["text"]
    statuses = [e.data["status"] for e in streamed if e.event == "status"]
    assert statuses == ["running", "queued", "running"]  # handed back, then resumed (not a delivery)
    reference = job_finished(fleet, fleet.submit(LONG)["id"])  # the same greedy job, uninterrupted
    assert job["output"]["token_ids"] == reference["output"]["token_ids"]


def test_killed_worker_job_is_reclaimed(fleet: FleetClient, rclient: redis.Redis, pool: WorkerPool) -> None:
    job, holder, finisher = _interrupt_holder_and_let_the_other_finish(fleet, rclient, pool, signal.SIGKILL)
    assert job["status"] == "succeeded" and finisher != holder
    assert rclient.hget(keys.job_hash(job["id"]), "attempt") == "2"
    assert len(job["output"]["token_ids"]) == LONG["max_tokens"]


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "shared.cli", *args], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


def test_cli_submit_status_stream_cancel(fleet: FleetClient) -> None:
    url = str(fleet.http.base_url).rstrip("/")
    submitted = _cli("submit", "def f(x):", "--max-tokens", "8", "--url", url)
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip()
    job = job_finished(fleet, job_id)
    status = _cli("status", job_id, "--url", url)
    assert status.returncode == 0 and json.loads(status.stdout)["output"] == job["output"]
    streamed = _cli("stream", job_id, "--url", url)
    assert streamed.returncode == 0 and streamed.stdout == job["output"]["text"]
    assert "succeeded" in streamed.stderr
    live = _cli("submit", "import os", "--max-tokens", "8", "--stream", "--url", url)
    assert live.returncode == 0 and "8 tokens" in live.stderr
    spaced = _cli("submit", "import os", "--max-tokens", "8", "--stream-interval-ms", "60000", "--url", url)
    assert spaced.returncode == 0, spaced.stderr
    job_finished(fleet, spaced.stdout.strip())
    tokens = [e.data["token_ids"] for e in fleet.stream(spaced.stdout.strip()) if e.event == "token"]
    assert len(tokens) <= 2 and sum(map(len, tokens)) == 8  # the first token, then the rest with the end
    refused = _cli("cancel", job_id, "--url", url)
    assert refused.returncode == 1 and "409" in refused.stderr
    missing = _cli("status", "nope", "--url", url)
    assert missing.returncode == 1 and "404" in missing.stderr
