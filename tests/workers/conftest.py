"""Speculation test models, made once per test session (tiny_pair, tiny_models: tests/helpers/models.py)."""

from pathlib import Path

import pytest


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

