"""A Redis restart mid-job loses nothing: the in-process worker drops what it held, Redis comes back from its
AOF, the job is reclaimed and resumed from the last token written, and finishes with every token once."""

import json
import logging
import threading
from pathlib import Path

import pytest
import redis

from shared import keys
from shared.redis_server import RedisServer, free_port
from shared.settings import ServiceSettings
from tests.helpers.redis_fixtures import FAST_TIMINGS, job_record, submit_job
from tests.helpers.waiting import wait_until
from workers.worker.main import Worker

MAX_TOKENS = 480


def test_redis_restart_mid_job(tiny_pair: tuple[Path, Path], tmp_path: Path) -> None:
    from workers.engine.config import EngineConfig
    from workers.engine.engine import Engine

    engine = Engine.from_config(
        EngineConfig.load(
            target_dir=str(tiny_pair[0]), draft_dir=str(tiny_pair[1]), max_num_seqs=1, num_threads=1
        )
    )
    server = RedisServer(tmp_path / "redis").start()
    settings = ServiceSettings(redis_url=server.url, **FAST_TIMINGS)  # type: ignore[arg-type]
    client = redis.Redis.from_url(server.url, decode_responses=True)
    worker = Worker(engine, client, settings, worker_id="w1")
    thread = threading.Thread(target=worker.run, name="worker")
    thread.start()
    try:
        job_id = submit_job(
            client, settings, prompt="def f(x):", max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True
        )
        wait_until(
            lambda: int(client.hget(keys.job_hash(job_id), "completion_tokens") or 0) > 0,
            interval_s=0.002,
            what="first tokens",
        )
        server.stop()  # a clean SHUTDOWN: the AOF holds everything acknowledged so far
        wait_until(lambda: not worker.leases, what="the worker to drop its job")
        server = RedisServer(tmp_path / "redis", port=server.port).start()
        done = wait_until(
            lambda: client.hget(keys.job_hash(job_id), "status") == "succeeded",
            timeout_s=60,
            what="the job to finish after the restart",
        )
        job = job_record(client, job_id)
        events = client.xrange(keys.job_events(job_id))
    finally:
        worker.request_stop(grace_s=0)
        thread.join(timeout=30)
        client.close()
        server.stop()
    assert done and job["completion_tokens"] == str(MAX_TOKENS) and int(job["attempt"]) >= 2
    token_ids = [int(t) for t in job["token_ids"].split(",")]
    assert len(token_ids) == MAX_TOKENS
    streamed = [t for _, e in events if e["type"] == "token" for t in json.loads(e["data"])["token_ids"]]
    assert streamed == token_ids
    assert not thread.is_alive()


def test_a_worker_started_before_its_redis_waits_for_it(
    tiny_pair: tuple[Path, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """It exited on its first Redis call, once its models had loaded; now it retries until Redis answers."""
    from workers.engine.config import EngineConfig
    from workers.engine.engine import Engine

    engine = Engine.from_config(
        EngineConfig.load(target_dir=str(tiny_pair[0]), draft_dir=str(tiny_pair[1]), max_num_seqs=1, num_threads=1)
    )
    port = free_port()
    settings = ServiceSettings(redis_url=f"redis://127.0.0.1:{port}/0", **FAST_TIMINGS)  # type: ignore[arg-type]
    client = redis.Redis.from_url(settings.redis_url, decode_responses=True)
    worker = Worker(engine, client, settings, worker_id="early")
    thread = threading.Thread(target=worker.run, name="worker")
    caplog.set_level(logging.WARNING, logger="workers.worker.main")
    thread.start()
    wait_until(lambda: any("redis is unreachable" in r.getMessage() for r in caplog.records), what="a retry")
    server = RedisServer(tmp_path / "redis", port=port).start()
    try:
        job_id = submit_job(client, settings, prompt="def f(x):", max_tokens=8, temperature=0)
        done = wait_until(lambda: client.hget(keys.job_hash(job_id), "status") == "succeeded", timeout_s=60,
                          what="the job, once Redis came up")  # fmt: skip
    finally:
        worker.request_stop(grace_s=0)
        thread.join(timeout=30)
        client.close()
        server.stop()
    assert done and thread.is_alive() is False
