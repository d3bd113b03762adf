"""Tiny random-weight checkpoints (HF layout), made once per test session."""

from pathlib import Path

import pytest

from workers.demo.tiny import make_tiny_model, make_tiny_pair

LAYOUTS = ("llama", "qwen2", "mistral")


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny-models")
    return {
        layout: make_tiny_model(root / layout, model_type=layout, seed=i) for i, layout in enumerate(LAYOUTS)
    }


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return make_tiny_pair(tmp_path_factory.mktemp("tiny-pair"))
