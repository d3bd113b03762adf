"""A real worker loop over a real engine (tiny random pair) in a thread of the test process, shared by the tests
of a module (it survives the per-test FLUSHALL: groups are re-created, model info re-published), and API keys."""

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from shared.redis_server import RedisServer
from shared.settings import ServiceSettings
from tests.conftest import FAST_TIMINGS


class ThreadWorker:
    def __init__(self, redis_url: str, target: Path, tmp: Path) -> None:
        from workers.engine.config import EngineConfig
        from workers.engine.engine import Engine
        from workers.worker.main import Worker

        settings = ServiceSettings(redis_url=redis_url, redis_dir=tmp, **FAST_TIMINGS)  # type: ignore[arg-type]
        cfg = EngineConfig(target_dir=str(target), kv_cache_mb=16, max_num_seqs=8, num_threads=1)
        self.client = redis.Redis.from_url(redis_url, decode_responses=True)
        self.worker = Worker(
            Engine(cfg, target), self.client, settings, worker_id="openai-test", model_name=str(target)
        )
        self.thread = threading.Thread(target=self.worker.run, name="engine-worker", daemon=True)

    def stop(self) -> None:
        self.worker.request_stop(0.0)
        self.thread.join(30)
        self.client.close()


@pytest.fixture(scope="module")
def engine_thread(
    redis_server: RedisServer, tiny_pair: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ThreadWorker]:
    worker = ThreadWorker(redis_server.url, tiny_pair[0], tmp_path_factory.mktemp("worker"))
    worker.thread.start()
    yield worker
    worker.stop()
