"""The Celery side has no import cycle: task modules register with the registry, the app includes them by name,
and importing a task module neither reads settings nor builds the Celery app."""

import subprocess
import sys

import pytest

from shared.schemas import WebhookEvent
from workers.tasks import registry
from workers.tasks.registry import BatchAction, NotRegistered


def test_importing_the_task_modules_builds_no_app_and_reads_no_settings() -> None:
    code = (
        "import sys\n"
        "import workers.tasks.batches, workers.tasks.webhooks, workers.tasks.outbox\n"
        "from celery import _state\n"
        "from shared.settings import get_settings\n"
        "assert 'workers.tasks.celery_app' not in sys.modules\n"
        "assert _state.default_app is None and not list(_state._get_active_apps())\n"
        "assert get_settings.cache_info().currsize == 0\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_the_task_modules_register_their_senders() -> None:
    import workers.tasks.batches  # noqa: F401
    import workers.tasks.webhooks  # noqa: F401

    assert set(registry._batch_senders) == set(BatchAction)
    assert len(registry._job_webhook_senders) == 1


def test_an_unregistered_action_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry, "_batch_senders", {})
    monkeypatch.setattr(registry, "_job_webhook_senders", [])
    with pytest.raises(NotRegistered):
        registry.send_batch(BatchAction.EXPAND, "batch_1")
    with pytest.raises(NotRegistered):
        registry.send_job_webhook("j", WebhookEvent.COMPLETED, "1-0", "http://x", "{}")


def test_senders_are_called_with_their_arguments(monkeypatch: pytest.MonkeyPatch) -> None:
    sent: list[tuple[object, ...]] = []
    monkeypatch.setattr(registry, "_batch_senders", {})
    monkeypatch.setattr(registry, "_job_webhook_senders", [])
    registry.register_batch(BatchAction.FINALIZE, lambda batch_id: sent.append(("finalize", batch_id)))
    registry.register_job_webhook(lambda *args: sent.append(args))
    registry.send_batch(BatchAction.FINALIZE, "batch_1")
    registry.send_job_webhook("j", WebhookEvent.START, "1-0", "http://x", "{}")
    assert sent == [("finalize", "batch_1"), ("j", WebhookEvent.START, "1-0", "http://x", "{}")]
