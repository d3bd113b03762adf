"""The demo target's EAGLE head, built with a micro recipe on the micro pair (seconds): byte-identical
builds, the marker and its fingerprint, no rebuild when built, an engine that serves it exactly."""

from pathlib import Path

import pytest

from tests.workers.demo.conftest import MICRO_RECIPE
from tests.workers.engine_runs import greedy, make_engine, run_all, tokens
from workers.demo.build import BUILD_MARKER, DemoPair
from workers.demo.eagle_build import (
    DEMO_HEAD_RECIPE,
    DemoHeadRecipe,
    build_head,
    ensure_demo_head,
    find_demo_head,
    head_dir,
)
from workers.eagle_train.train import EagleRecipe

MICRO_HEAD_RECIPE = DemoHeadRecipe(
    name="micro-eagle-v1",
    pair_name=MICRO_RECIPE.name,
    head=EagleRecipe(
        num_sequences=16, prompt_len=8, gen_len=8, gen_batch_size=8, num_steps=4, batch_size=4,
        learning_rate=1e-2, warmup_steps=1,
    ),
    max_files=10,
)  # fmt: skip
HEAD_FILES = ("config.json", "model.safetensors")


@pytest.fixture(scope="module")
def micro_head(micro_home: Path, micro_pair: DemoPair) -> Path:
    return ensure_demo_head(micro_pair, micro_home, recipe=MICRO_HEAD_RECIPE)


def test_two_head_builds_are_byte_identical(tmp_path: Path, micro_pair: DemoPair, micro_head: Path) -> None:
    build_head(micro_pair, MICRO_HEAD_RECIPE, tmp_path)
    for name in HEAD_FILES:
        assert (tmp_path / name).read_bytes() == (micro_head / name).read_bytes(), name


def test_the_head_lands_beside_the_pair_with_its_marker(micro_home: Path, micro_pair: DemoPair, micro_head: Path) -> None:
    assert micro_head == head_dir(micro_home, MICRO_HEAD_RECIPE) and micro_head.parent == micro_pair.target_dir.parent.parent
    assert find_demo_head(micro_home, MICRO_HEAD_RECIPE) == micro_head
    assert not list(micro_head.parent.glob(".micro-eagle-v1.building-*"))
    marker = (micro_head / BUILD_MARKER).read_text()
    assert MICRO_HEAD_RECIPE.fingerprint() in marker and '"build_time_s"' in marker


def test_ensure_does_not_rebuild_a_built_head(micro_home: Path, micro_pair: DemoPair, micro_head: Path) -> None:
    weights_mtime_ns = (micro_head / "model.safetensors").stat().st_mtime_ns
    assert ensure_demo_head(micro_pair, micro_home, recipe=MICRO_HEAD_RECIPE) == micro_head
    assert (micro_head / "model.safetensors").stat().st_mtime_ns == weights_mtime_ns


def test_a_head_of_another_recipe_is_not_found(micro_home: Path, micro_head: Path) -> None:
    other = DemoHeadRecipe(name=MICRO_HEAD_RECIPE.name, pair_name="other", head=MICRO_HEAD_RECIPE.head)
    assert find_demo_head(micro_home, other) is None


def test_the_engine_serves_the_micro_head_exactly(micro_pair: DemoPair, micro_head: Path) -> None:
    prompts = {str(i): ([5 + i, 60, 7, 80 + i, 9], greedy(12)) for i in range(4)}
    plain = run_all(make_engine(micro_pair.target_dir, dtype="float64"), prompts)
    # a fixed k: the micro head costs what its micro target does, so measured lengths would draft nothing
    engine = make_engine(
        micro_pair.target_dir, None, micro_head, dtype="float64", speculative_method="eagle", is_adaptive=False
    )
    outs = run_all(engine, prompts)
    assert {r: tokens(o) for r, o in outs.items()} == {r: tokens(o) for r, o in plain.items()}
    assert engine.speculator.stats.counts.num_steps > 0


def test_demo_head_recipe_is_pinned() -> None:
    # Changing the recipe changes the head: bump DEMO_HEAD_RECIPE.name's version, then update this fingerprint.
    assert DEMO_HEAD_RECIPE.name == "demo-v3-eagle-v3" and DEMO_HEAD_RECIPE.pair_name == "demo-v3"
    assert DEMO_HEAD_RECIPE.fingerprint() == "bf4da11c9ef1"
