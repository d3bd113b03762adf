"""`specfleet gateway --workers N` sets up one prometheus-client multiprocess directory for its processes:
empty at the start of a run; a temporary one is removed afterwards, one the operator named is kept."""

import os
from pathlib import Path

import pytest

from shared.cli.fleet import MULTIPROC_DIR_ENV, _shared_metrics_dir


def test_a_temporary_directory_per_run(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(MULTIPROC_DIR_ENV, raising=False)
    with _shared_metrics_dir(2):
        path = Path(os.environ[MULTIPROC_DIR_ENV])
        assert path.is_dir() and list(path.iterdir()) == []
        (path / "counter_123.db").write_bytes(b"x")
    assert MULTIPROC_DIR_ENV not in os.environ and not path.exists()


def test_the_operators_directory_is_emptied_and_kept(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    (tmp_path / "counter_1.db").write_bytes(b"stale")
    (tmp_path / "notes.txt").write_text("not ours")
    monkeypatch.setenv(MULTIPROC_DIR_ENV, str(tmp_path))
    with _shared_metrics_dir(2):
        assert os.environ[MULTIPROC_DIR_ENV] == str(tmp_path)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]
    assert os.environ[MULTIPROC_DIR_ENV] == str(tmp_path) and tmp_path.is_dir()


def test_one_process_needs_no_directory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(MULTIPROC_DIR_ENV, raising=False)
    with _shared_metrics_dir(1):
        assert MULTIPROC_DIR_ENV not in os.environ
