from pathlib import Path

import pytest

from shared.schemas import Priority
from shared.settings import DEFAULT_CONFIG_PATH, ServiceSettings


def test_yaml_file_is_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "service.yaml"
    config.write_text("port: 9123\nqueue_limits:\n  batch: 7\nclaim_timeout_s: 12.5\n")
    monkeypatch.setenv("SPECFLEET_CONFIG", str(config))
    settings = ServiceSettings()
    assert settings.port == 9123
    assert settings.queue_limits.for_priority(Priority.BATCH) == 7
    assert settings.queue_limits.for_priority(Priority.INTERACTIVE) == 1000
    assert settings.claim_timeout_s == 12.5


def test_environment_overrides_yaml(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "service.yaml"
    config.write_text("port: 9123\nredis_url: redis://from-yaml:1/0\n")
    monkeypatch.setenv("SPECFLEET_CONFIG", str(config))
    monkeypatch.setenv("SPECFLEET_PORT", "9200")
    monkeypatch.setenv("SPECFLEET_QUEUE_LIMITS__INTERACTIVE", "3")
    monkeypatch.setenv("REDIS_URL", "redis://from-env:6379/2")
    settings = ServiceSettings()
    assert settings.port == 9200
    assert settings.queue_limits.interactive == 3
    assert settings.redis_url == "redis://from-env:6379/2"


def test_repo_config_is_valid(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SPECFLEET_CONFIG", raising=False)
    monkeypatch.delenv("REDIS_URL", raising=False)
    assert DEFAULT_CONFIG_PATH.exists()
    settings = ServiceSettings()
    assert settings.env == "dev"
    assert settings.redis_url is None  # `specfleet up` starts its own Redis
    assert settings.heartbeat_interval_s < settings.claim_timeout_s


def test_invalid_value_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECFLEET_MAX_DELIVERIES", "0")
    with pytest.raises(ValueError, match="max_deliveries"):
        ServiceSettings()


def test_webhook_settings_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    from shared.settings import ServiceSettings

    monkeypatch.setenv("SPECFLEET_WEBHOOK_ALLOW_HOSTS", "127.0.0.1/8, ::1,hooks.internal")
    monkeypatch.setenv("SPECFLEET_WEBHOOK_SECRET", "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw")
    settings = ServiceSettings()
    assert settings.webhook_allow_hosts == ["127.0.0.1/8", "::1", "hooks.internal"]
    assert settings.webhook_secret.get_secret_value().startswith("whsec_MfKQ")
    assert "whsec" not in repr(settings)


def test_prod_refuses_the_dev_webhook_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    from shared.settings import ServiceSettings

    with pytest.raises(ValueError, match="SPECFLEET_WEBHOOK_SECRET"):
        ServiceSettings(env="prod")
    monkeypatch.setenv("SPECFLEET_WEBHOOK_SECRET", "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw")
    assert ServiceSettings(env="prod").env == "prod"
