"""The real worker loop over a real engine (tiny random model) in a thread of the test process.

engine_thread: one per test module, on the session's Redis (it survives the per-test FLUSHALL: groups are
re-created, model info re-published); engine_worker: one per test, with the webhook tests' settings.
"""

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from shared import redis_url as redis_urls
from shared.redis_server import RedisServer
from shared.settings import ServiceSettings
from tests.helpers.redis_fixtures import FAST_TIMINGS


class EngineThread:
    def __init__(
        self, settings: ServiceSettings, target: Path, *, worker_id: str, model_name: str, max_num_seqs: int
    ) -> None:
        from workers.engine.config import EngineConfig
        from workers.engine.engine import Engine
        from workers.worker.main import Worker

        cfg = EngineConfig(  # plain decoding by default: the tiny target has no draft
            target_dir=str(target), kv_cache_mb=16, max_num_seqs=max_num_seqs, num_threads=1, speculative_method="none"
        )
        self.client = redis_urls.client(str(settings.redis_url), decode_responses=True)
        self.worker = Worker(Engine(cfg, target), self.client, settings, worker_id=worker_id, model_name=model_name)
        self.thread = threading.Thread(target=self.worker.run, name="engine-worker", daemon=True)

    def start(self) -> "EngineThread":
        self.thread.start()
        return self

    def stop(self) -> None:
        self.worker.request_stop(0.0)
        self.thread.join(30)
        self.client.close()


@pytest.fixture(scope="module")
def engine_thread(
    redis_server: RedisServer, tiny_target: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[EngineThread]:
    settings = ServiceSettings(
        redis_url=redis_server.url, redis_dir=tmp_path_factory.mktemp("worker"), **FAST_TIMINGS  # type: ignore[arg-type]
    )
    worker = EngineThread(
        settings, tiny_target, worker_id="openai-test", model_name=str(tiny_target), max_num_seqs=8
    ).start()
    yield worker
    worker.stop()


@pytest.fixture
def engine_worker(hook_settings: ServiceSettings, tiny_target: Path) -> Iterator[EngineThread]:
    worker = EngineThread(
        hook_settings, tiny_target, worker_id="engine-test", model_name="tiny", max_num_seqs=16
    ).start()
    yield worker
    worker.stop()
