"""Test helpers and fixtures shared by the whole suite (registered by tests/conftest.py's pytest_plugins).

    redis_fixtures.py one real redis-server per session (flushed per test), settings, API keys, submit_job
    gateway.py        the real gateway served by uvicorn in a thread (ThreadedGateway, the `gateway` fixture)
    waiting.py        wait_until: wait on a condition, never sleep and hope
    played_worker.py  step_output and PlayedWorker, for the tests that play the engine
    models.py         the tiny random model pair, built once per test run (tiny_pair, tiny_target)
    engine_worker.py  one real worker loop over a real engine in a thread (engine_thread, engine_worker)
    tasks.py          a real Celery worker process, a webhook receiver, the settings they share
    up_process.py     a real `specfleet up` process, read and stopped like a user would
"""

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
