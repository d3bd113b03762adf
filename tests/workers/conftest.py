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


@pytest.fixture(scope="session")
def eagle_models(tiny_pair: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A ONE-layer tiny target (its own checkpoint, the tiny pair's tokenizer); a draft agreeing with it
    (perturbed copy); EAGLE heads for it: copy_head agrees most of the time (workers/demo/tiny.py),
    random_head hardly ever."""
    from workers.demo.tiny import make_copy_head, make_perturbed_copy, make_random_head, make_tiny_model

    root = tmp_path_factory.mktemp("eagle-models")
    target = make_tiny_model(root / "target", num_layers=1, seed=3, tokenizer_from=tiny_pair[0])
    return {
        "target": target,
        "close_draft": make_perturbed_copy(target, root / "close", noise_std=0.005),
        "copy_head": make_copy_head(target, root / "copy-head"),
        "random_head": make_random_head(target, root / "random-head"),
    }
