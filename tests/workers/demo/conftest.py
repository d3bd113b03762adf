"""A micro recipe (tiny dims, a few steps, a slice of the corpus, a grown target) so a pair builds in about a second."""

from pathlib import Path

import pytest

from workers.demo.build import DemoPair, DemoRecipe, ensure_demo_pair
from workers.demo.train import ModelRecipe

MICRO_RECIPE = DemoRecipe(
    name="micro-v2",
    vocab_size=320,
    target=ModelRecipe(
        num_layers=1, hidden_size=32, num_heads=2, intermediate_size=64,
        num_steps=4, learning_rate=1e-2, warmup_steps=1, batch_size=4, seq_len=32,
    ),
    target_growth=ModelRecipe(
        num_layers=2, hidden_size=32, num_heads=2, intermediate_size=64,
        num_steps=2, learning_rate=1e-2, warmup_steps=1, batch_size=4, seq_len=32,
    ),
    draft=ModelRecipe(
        num_layers=1, hidden_size=16, num_heads=1, intermediate_size=32,
        num_steps=4, learning_rate=1e-2, warmup_steps=1, batch_size=4, seq_len=32,
    ),
    max_files=10,
)  # fmt: skip


@pytest.fixture(scope="session")
def micro_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("specfleet-home")


@pytest.fixture(scope="session")
def micro_pair(micro_home: Path) -> DemoPair:
    """One micro pair, built once per session and shared read-only by the tests."""
    return ensure_demo_pair(micro_home, recipe=MICRO_RECIPE)
