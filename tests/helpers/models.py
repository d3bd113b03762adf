"""Tiny random-weight checkpoints (HF layout, workers/demo/tiny.py), built once per test run: the target +
draft pair, and one model per supported layout."""

from pathlib import Path

import pytest

LAYOUTS = ("llama", "qwen2", "mistral")


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(target, draft): tiny random-weight checkpoints sharing one tokenizer, made once per session."""
    from workers.demo.tiny import make_tiny_pair

    return make_tiny_pair(tmp_path_factory.mktemp("tiny-pair"))


@pytest.fixture(scope="session")
def tiny_target(tiny_pair: tuple[Path, Path]) -> Path:
    """The tiny pair's target alone."""
    return tiny_pair[0]


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One tiny model per layout: {"llama": dir, "qwen2": dir, "mistral": dir}."""
    from workers.demo.tiny import make_tiny_model

    root = tmp_path_factory.mktemp("tiny-models")
    return {
        layout: make_tiny_model(root / layout, model_type=layout, seed=i) for i, layout in enumerate(LAYOUTS)
    }


@pytest.fixture(scope="session")
def compile_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One compile cache (EngineConfig.compile_cache_dir) for the run's compiled engines: a model compiled
    again hits it, and a cached graph must never bring another model's frozen weights."""
    return tmp_path_factory.mktemp("compile-cache")
