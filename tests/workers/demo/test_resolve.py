"""The demo pair as the default model is resolved beside the engine, never inside it."""

from pathlib import Path

import pytest

from workers.demo import build, eagle_build
from workers.demo.build import DemoPair
from workers.demo.resolve import with_demo_pair
from workers.engine.config import EngineConfig
from workers.engine.engine import Engine


@pytest.fixture
def fake_pair(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> DemoPair:
    pair = DemoPair(target_dir=tmp_path / "target", draft_dir=tmp_path / "draft")
    monkeypatch.setattr(build, "ensure_demo_pair", lambda: pair)
    monkeypatch.setattr(eagle_build, "ensure_demo_head", lambda p: p.target_dir.parent / "eagle")
    return pair


def test_a_named_target_is_kept(fake_pair: DemoPair) -> None:
    cfg = EngineConfig(target_dir="/models/t")
    assert with_demo_pair(cfg) is cfg


def test_no_target_means_the_demo_pair(fake_pair: DemoPair) -> None:
    cfg = with_demo_pair(EngineConfig(kv_cache_mb=8))
    assert (cfg.target_dir, cfg.draft_dir) == (str(fake_pair.target_dir), str(fake_pair.draft_dir))
    assert cfg.kv_cache_mb == 8


def test_no_target_means_the_demo_head_too(fake_pair: DemoPair, tmp_path: Path) -> None:
    assert with_demo_pair(EngineConfig()).eagle_dir == str(tmp_path / "eagle")
    assert with_demo_pair(EngineConfig(eagle_dir="/models/h")).eagle_dir == "/models/h"


def test_a_named_draft_is_kept_with_the_demo_target(fake_pair: DemoPair) -> None:
    cfg = with_demo_pair(EngineConfig(draft_dir="/models/d"))
    assert (cfg.target_dir, cfg.draft_dir) == (str(fake_pair.target_dir), "/models/d")


def test_the_engine_does_not_build_models() -> None:
    with pytest.raises(ValueError, match="target_dir"):
        Engine.from_config(EngineConfig())
