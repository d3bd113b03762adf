"""configs/ holds overrides only: every key is a known setting, and a value that differs from its default says
so (`# override: why`, on its line or the line above). The defaults live in one place: the pydantic models
(shared/settings.py ServiceSettings, workers/engine/config.py EngineConfig)."""

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import BaseModel

from shared.api_keys import new_webhook_secret
from shared.settings import ServiceSettings
from workers.engine.config import ENV_PREFIX as ENGINE_ENV_PREFIX
from workers.engine.config import EngineConfig

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
SERVICE_ENV_PREFIX = "SPECFLEET_"
MARK = "# override:"
TEST_WEBHOOK_SECRET = new_webhook_secret()  # SPECFLEET_ENV=prod refuses the built-in dev secret
NO_FILE = CONFIGS / "no-such-file.yaml"  # EngineConfig.load(NO_FILE): environment and defaults only


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No SPECFLEET_* or REDIS_URL from the machine; the service reads an empty file unless a test says so."""
    for name in list(os.environ):
        if name.startswith(SERVICE_ENV_PREFIX) or name == "REDIS_URL":
            monkeypatch.delenv(name)
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    monkeypatch.setenv("SPECFLEET_CONFIG", str(empty))


def is_marked(lines: list[str], index: int) -> bool:
    return MARK in lines[index] or (index > 0 and lines[index - 1].strip().startswith(MARK))


def yaml_leaves(document: dict[str, Any], prefix: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    for key, value in document.items():
        if isinstance(value, dict) and value:
            yield from yaml_leaves(value, (*prefix, key))
        else:
            yield (*prefix, key)


def line_of(lines: list[str], path: tuple[str, ...]) -> int:
    """The index of the line that sets the leaf `path` (keys nest by indentation, in order)."""
    start = 0
    for key in path:
        start = next(i for i in range(start, len(lines)) if lines[i].split("#")[0].strip().startswith(f"{key}:"))
    return start


def leaf(obj: object, path: tuple[str, ...]) -> object:
    for key in path:
        obj = getattr(obj, key)
    return obj


def known_service_path(path: tuple[str, ...]) -> bool:
    model: type[BaseModel] = ServiceSettings
    for i, key in enumerate(path):
        if key not in model.model_fields:
            return False
        annotation = model.model_fields[key].annotation
        if i < len(path) - 1:
            if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
                return False
            model = annotation
    return True


def check_service_yaml(path: Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    text = path.read_text()
    lines = text.splitlines()
    document = yaml.safe_load(text) or {}
    problems = [f"{'.'.join(p)}: not a service setting" for p in yaml_leaves(document) if not known_service_path(p)]
    if problems:
        return problems
    monkeypatch.setenv("SPECFLEET_CONFIG", str(path))
    loaded, default = ServiceSettings(), ServiceSettings.model_construct()
    for p in yaml_leaves(document):
        if leaf(loaded, p) != leaf(default, p) and not is_marked(lines, line_of(lines, p)):
            problems.append(f"{'.'.join(p)}: {leaf(loaded, p)!r} contradicts the default {leaf(default, p)!r}")
        elif leaf(loaded, p) == leaf(default, p):
            problems.append(f"{'.'.join(p)}: restates the default {leaf(default, p)!r} (files hold overrides only)")
    return problems


def check_engine_yaml(path: Path) -> list[str]:
    text = path.read_text()
    lines = text.splitlines()
    section = (yaml.safe_load(text) or {}).get("engine") or {}
    unknown = sorted(set(section) - set(EngineConfig.field_names()))
    if unknown:
        return [f"{name}: not an engine setting" for name in unknown]
    loaded, default = EngineConfig.load(path), EngineConfig()
    problems = []
    for name in section:
        now, before = getattr(loaded, name), getattr(default, name)
        if now == before:
            problems.append(f"{name}: restates the default {before!r} (files hold overrides only)")
        elif not is_marked(lines, line_of(lines, ("engine", name))):
            problems.append(f"{name}: {now!r} contradicts the default {before!r}")
    return problems


def check_env_file(path: Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    lines = path.read_text().splitlines()
    problems = []
    for index, line in enumerate(lines):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        name, _, value = line.partition("=")
        with monkeypatch.context() as env:
            env.setenv("SPECFLEET_WEBHOOK_SECRET", TEST_WEBHOOK_SECRET)  # from the environment, as deployed
            env.setenv(name, value)
            if name.startswith(ENGINE_ENV_PREFIX) and name[len(ENGINE_ENV_PREFIX) :].lower() in EngineConfig.field_names():
                field = name[len(ENGINE_ENV_PREFIX) :].lower()
                now, before = getattr(EngineConfig.load(NO_FILE), field), getattr(EngineConfig(), field)
            elif name == "REDIS_URL" or (
                name.startswith(SERVICE_ENV_PREFIX)
                and known_service_path(tuple(name[len(SERVICE_ENV_PREFIX) :].lower().split("__")))
            ):
                p = ("redis_url",) if name == "REDIS_URL" else tuple(name[len(SERVICE_ENV_PREFIX) :].lower().split("__"))
                now, before = leaf(ServiceSettings(), p), leaf(ServiceSettings.model_construct(), p)
            else:
                problems.append(f"{name}: not a setting")
                continue
        if now == before:
            problems.append(f"{name}: restates the default {before!r} (files hold overrides only)")
        elif not is_marked(lines, index):
            problems.append(f"{name}: {now!r} contradicts the default {before!r}")
    return problems


# ---- the repository's files --------------------------------------------------------------------------------
def test_service_yaml_holds_only_marked_overrides(monkeypatch: pytest.MonkeyPatch) -> None:
    assert check_service_yaml(CONFIGS / "service.yaml", monkeypatch) == []


def test_engine_yaml_holds_only_marked_overrides() -> None:
    assert check_engine_yaml(CONFIGS / "engine.yaml") == []


def test_fleet_env_holds_only_marked_overrides(monkeypatch: pytest.MonkeyPatch) -> None:
    assert check_env_file(CONFIGS / "fleet.env", monkeypatch) == []


def test_every_config_file_is_checked() -> None:
    """Settings files here; the monitoring stack's folders are checked by tests/configs/test_monitoring.py, the
    locustfile (not a settings file: a load test for teams that use locust) by tests/configs/test_locustfile.py."""
    assert sorted(p.name for p in CONFIGS.iterdir() if p.is_file()) == [
        "engine.yaml", "fleet.env", "locustfile.py", "service.yaml"
    ]
    assert sorted(p.name for p in CONFIGS.iterdir() if p.is_dir()) == ["grafana", "prometheus"]


# ---- the checks catch what they are for ----------------------------------------------------------------------
def test_unknown_and_unmarked_service_keys_are_caught(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bad = tmp_path / "service.yaml"
    bad.write_text("shutdown_grace_s: 5\nqueue_limits:\n  batch: 7\n")
    assert check_service_yaml(bad, monkeypatch) == [
        "shutdown_grace_s: 5.0 contradicts the default 10.0",
        "queue_limits.batch: 7 contradicts the default 100000",
    ]
    bad.write_text("port: 8000\n")
    assert check_service_yaml(bad, monkeypatch) == ["port: restates the default 8000 (files hold overrides only)"]
    bad.write_text("queue_limits:\n  bulk: 7\n")
    assert check_service_yaml(bad, monkeypatch) == ["queue_limits.bulk: not a service setting"]
    good = tmp_path / "good.yaml"
    good.write_text("# override: a small box\nshutdown_grace_s: 5\nqueue_limits:\n  batch: 7  # override: ditto\n")
    assert check_service_yaml(good, monkeypatch) == []
    assert ServiceSettings().shutdown_grace_s == 5.0  # and the file is what the service reads


def test_unknown_and_unmarked_engine_keys_are_caught(tmp_path: Path) -> None:
    bad = tmp_path / "engine.yaml"
    bad.write_text("engine:\n  speculative_method: none\n  num_threads: 0\n")
    assert check_engine_yaml(bad) == [
        "speculative_method: <SpeculativeMethod.NONE: 'none'> contradicts the default None",
        "num_threads: restates the default 0 (files hold overrides only)",
    ]
    bad.write_text("engine:\n  num_treads: 1\n")
    assert check_engine_yaml(bad) == ["num_treads: not an engine setting"]
    good = tmp_path / "good.yaml"
    good.write_text("engine:\n  speculative_method: none  # override: plain decoding on this box\n")
    assert check_engine_yaml(good) == []


def test_unknown_and_unmarked_env_lines_are_caught(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    env_file = tmp_path / "fleet.env"
    env_file.write_text("SPECFLEET_SHUTDOWN_GRACE_S=20\nSPECFLEET_PORT=8000\nSPECFLEET_BOGUS=1\n"
                        "# override: one thread\nSPECFLEET_ENGINE_NUM_THREADS=1\nSPECFLEET_ENGINE_TREE_SIZE=3\n")
    assert check_env_file(env_file, monkeypatch) == [
        "SPECFLEET_SHUTDOWN_GRACE_S: 20.0 contradicts the default 10.0",
        "SPECFLEET_PORT: restates the default 8000 (files hold overrides only)",
        "SPECFLEET_BOGUS: not a setting",
        "SPECFLEET_ENGINE_TREE_SIZE: 3 contradicts the default 0",
    ]


# ---- precedence: CLI flag > environment > file > default -------------------------------------------------
def test_engine_precedence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "engine.yaml"
    config.write_text("engine:\n  num_threads: 3\n  max_num_seqs: 5\n  tree_size: 7\n")
    monkeypatch.setenv("SPECFLEET_ENGINE_MAX_NUM_SEQS", "6")
    monkeypatch.setenv("SPECFLEET_ENGINE_TREE_SIZE", "8")
    monkeypatch.setenv("SPECFLEET_ENGINE_IS_ADAPTIVE", "false")
    cfg = EngineConfig.load(config, tree_size=9, num_threads=None)  # None: the flag was not given
    assert (cfg.num_threads, cfg.max_num_seqs, cfg.tree_size, cfg.is_adaptive) == (3, 6, 9, False)
    assert cfg.block_size == EngineConfig().block_size


def test_engine_settings_are_validated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "engine.yaml"
    config.write_text("engine:\n  num_treads: 1\n")
    with pytest.raises(ValueError, match="num_treads"):
        EngineConfig.load(config)
    monkeypatch.setenv("SPECFLEET_ENGINE_SPECULATIVE_METHOD", "eagle9")
    with pytest.raises(ValueError, match="speculative_method"):
        EngineConfig.load(tmp_path / "missing.yaml")
    with pytest.raises(ValueError, match="speculative_k_min"):
        EngineConfig(speculative_k_min=5, num_speculative_tokens=4)
    with pytest.raises(ValueError, match="block_size"):
        EngineConfig(block_size=0)


def test_service_file_names_unknown_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "service.yaml"
    config.write_text("prot: 8001\n")
    monkeypatch.setenv("SPECFLEET_CONFIG", str(config))
    with pytest.raises(ValueError, match="prot"):
        ServiceSettings()
