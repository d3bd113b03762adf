import dataclasses
import os
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from tests.workers.demo.conftest import MICRO_RECIPE
from workers.demo.build import (
    BUILD_MARKER,
    DEMO_RECIPE,
    DemoPair,
    build_pair,
    build_record,
    ensure_demo_pair,
    find_demo_pair,
    pair_dir,
    specfleet_home,
)
from workers.demo.corpus import corpus_files, split_corpus
from workers.demo.tokenizer import EOS_TOKEN, EOS_TOKEN_ID

PAIR_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
)


def test_two_builds_are_byte_identical(tmp_path: Path, micro_pair: DemoPair) -> None:
    build_pair(MICRO_RECIPE, tmp_path)

    for role, built_dir in (("target", micro_pair.target_dir), ("draft", micro_pair.draft_dir)):
        for name in PAIR_FILES:
            assert (tmp_path / role / name).read_bytes() == (built_dir / name).read_bytes(), f"{role}/{name}"


@pytest.mark.parametrize("role", ["target", "draft"])
def test_pair_loads_with_transformers_and_runs_a_forward(micro_pair: DemoPair, role: str) -> None:
    model_dir = micro_pair.target_dir if role == "target" else micro_pair.draft_dir
    recipe = (MICRO_RECIPE.target_growth or MICRO_RECIPE.target) if role == "target" else MICRO_RECIPE.draft

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = tokenizer("def main(argv):\n    ", return_tensors="pt")["input_ids"]  # [1, seq]
    with torch.inference_mode():
        logits = model(input_ids=ids).logits  # [1, seq, vocab]

    assert type(model).__name__ == "LlamaForCausalLM"
    assert model.config.num_hidden_layers == recipe.num_layers
    assert model.config.hidden_size == recipe.hidden_size
    assert model.dtype == torch.float32
    assert logits.shape == (1, ids.shape[1], MICRO_RECIPE.vocab_size)
    assert torch.isfinite(logits).all()
    assert model.config.eos_token_id == EOS_TOKEN_ID
    assert GenerationConfig.from_pretrained(model_dir).eos_token_id == EOS_TOKEN_ID
    assert tokenizer.eos_token == EOS_TOKEN
    assert tokenizer.decode(ids[0]) == "def main(argv):\n    "


def test_target_and_draft_share_the_tokenizer(micro_pair: DemoPair) -> None:
    target_tokenizer = (micro_pair.target_dir / "tokenizer.json").read_bytes()

    assert target_tokenizer == (micro_pair.draft_dir / "tokenizer.json").read_bytes()


def test_build_record_lists_no_held_out_file_among_training_files(micro_pair: DemoPair) -> None:
    record = build_record(micro_pair)
    split = split_corpus(corpus_files(), max_files=MICRO_RECIPE.max_files)

    assert record["corpus"]["train_files"] == [path.name for path in split.train_files]
    assert set(record["corpus"]["train_files"]).isdisjoint(record["corpus"]["held_out_files"])
    assert record["corpus"]["held_out_files"] == [path.name for path in split.held_out_files]
    assert record["fingerprint"] == MICRO_RECIPE.fingerprint()


def test_ensure_does_not_rebuild_a_built_pair(micro_home: Path, micro_pair: DemoPair) -> None:
    marker = micro_pair.target_dir.parent / BUILD_MARKER
    mtime_ns = marker.stat().st_mtime_ns
    weights_mtime_ns = (micro_pair.target_dir / "model.safetensors").stat().st_mtime_ns

    again = ensure_demo_pair(micro_home, recipe=MICRO_RECIPE)

    assert again == micro_pair
    assert marker.stat().st_mtime_ns == mtime_ns
    assert (micro_pair.target_dir / "model.safetensors").stat().st_mtime_ns == weights_mtime_ns


def test_force_rebuilds_in_place(tmp_path: Path) -> None:
    first = ensure_demo_pair(tmp_path, recipe=MICRO_RECIPE)
    weights = (first.target_dir / "model.safetensors").read_bytes()
    inode = (first.target_dir / "model.safetensors").stat().st_ino

    second = ensure_demo_pair(tmp_path, force=True, recipe=MICRO_RECIPE)

    assert second == first
    assert (second.target_dir / "model.safetensors").stat().st_ino != inode  # a new file, renamed in
    assert (second.target_dir / "model.safetensors").read_bytes() == weights
    assert build_record(second)["name"] == MICRO_RECIPE.name
    assert sorted(path.name for path in (tmp_path / "models").iterdir()) == [f".{MICRO_RECIPE.name}.lock", MICRO_RECIPE.name]


def test_failed_build_leaves_no_pair_and_no_partial_files(tmp_path: Path) -> None:
    # The draft cannot draw a window longer than the corpus: the build fails after the target was saved.
    too_long = dataclasses.replace(MICRO_RECIPE.draft, seq_len=10**8)
    broken = dataclasses.replace(MICRO_RECIPE, draft=too_long)

    with pytest.raises(RuntimeError):
        ensure_demo_pair(tmp_path, recipe=broken)

    assert find_demo_pair(tmp_path, broken) is None
    assert not pair_dir(tmp_path, broken).exists()
    assert [path.name for path in (tmp_path / "models").iterdir()] == [f".{MICRO_RECIPE.name}.lock"]


def test_leftovers_of_a_killed_build_are_ignored_then_removed(tmp_path: Path) -> None:
    leftover = tmp_path / "models" / f".{MICRO_RECIPE.name}.building-killed"
    (leftover / "target").mkdir(parents=True)
    (leftover / "target" / "model.safetensors").write_bytes(b"half")

    assert find_demo_pair(tmp_path, MICRO_RECIPE) is None
    pair = ensure_demo_pair(tmp_path, recipe=MICRO_RECIPE)

    assert not leftover.exists()
    assert (pair.target_dir / "model.safetensors").stat().st_size > 4


def test_a_pair_built_from_another_recipe_is_rebuilt(tmp_path: Path) -> None:
    other = dataclasses.replace(MICRO_RECIPE, seed=7)  # same name, other bytes
    ensure_demo_pair(tmp_path, recipe=other)
    other_weights = (pair_dir(tmp_path, other) / "target" / "model.safetensors").read_bytes()

    assert find_demo_pair(tmp_path, MICRO_RECIPE) is None
    pair = ensure_demo_pair(tmp_path, recipe=MICRO_RECIPE)

    assert build_record(pair)["fingerprint"] == MICRO_RECIPE.fingerprint()
    assert (pair.target_dir / "model.safetensors").read_bytes() != other_weights


def test_home_defaults_to_env_then_user_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SPECFLEET_HOME", str(tmp_path))
    assert specfleet_home() == tmp_path
    assert pair_dir() == tmp_path / "models" / DEMO_RECIPE.name

    monkeypatch.delenv("SPECFLEET_HOME")
    assert specfleet_home() == Path(os.path.expanduser("~/.cache/specfleet"))
    assert specfleet_home(tmp_path / "explicit") == tmp_path / "explicit"


def test_demo_recipe_is_pinned() -> None:
    # Changing the recipe changes the pair: bump DEMO_RECIPE.name's version, then update this fingerprint.
    assert DEMO_RECIPE.name == "demo-v3"
    assert DEMO_RECIPE.fingerprint() == "af9a7ff1dc21"


def test_growth_must_deepen_the_target_at_its_width() -> None:
    wider = dataclasses.replace(MICRO_RECIPE.target, num_layers=2, hidden_size=64)
    not_a_multiple = dataclasses.replace(MICRO_RECIPE.target, num_layers=3)
    deeper_target = dataclasses.replace(MICRO_RECIPE.target, num_layers=2)

    for growth in (wider, not_a_multiple):
        with pytest.raises(ValueError, match="target_growth"):
            dataclasses.replace(MICRO_RECIPE, target=deeper_target, target_growth=growth)
    assert MICRO_RECIPE.target_num_steps == MICRO_RECIPE.target.num_steps + 2
