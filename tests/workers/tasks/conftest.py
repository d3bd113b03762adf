from tests.tasks_fixtures import celery_worker, engine_worker, hook_settings, receiver, tiny_target  # noqa: F401
