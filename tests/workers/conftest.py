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


@pytest.fixture(scope="session")
def spec_models(tiny_pair: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """target; a draft agreeing ~45% (perturbed target); an unrelated random draft; a NaN-poisoned draft."""
    from workers.demo.tiny import make_perturbed_copy

    target, random_draft = tiny_pair
    root = tmp_path_factory.mktemp("spec-drafts")
    return {
        "target": target,
        "close_draft": make_perturbed_copy(target, root / "close", noise_std=0.005),
        "random_draft": random_draft,
        "poisoned_draft": make_perturbed_copy(target, root / "poisoned", noise_std=0.0, poison=True),
    }
