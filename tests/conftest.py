"""The suite's fixtures live in tests/helpers/ (one module per kind); this file only registers them.

    redis_fixtures  one real redis-server per session (flushed per test), settings, API keys, submit_job
    gateway         the real gateway served by uvicorn in a thread (ThreadedGateway, `gateway`)
    models          the tiny random model pair, built once per run
    engine_worker   a real worker loop over a real engine in a thread
    tasks           a real Celery worker process, a webhook receiver, their settings
"""

pytest_plugins = [
    "tests.helpers.redis_fixtures",
    "tests.helpers.gateway",
    "tests.helpers.models",
    "tests.helpers.engine_worker",
    "tests.helpers.tasks",
]
