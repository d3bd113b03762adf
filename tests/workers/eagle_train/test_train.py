"""train-eagle on the tiny one-layer target: deterministic bytes, a head the engine loads and stays exact with,
the CLI, and what the loss reads."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from shared.cli.main import app
from tests.workers.engine_runs import greedy, run_all, spec_engine, tokens
from tests.workers.spec.test_engine_speculation import make_prompts
from workers.demo.tiny import training_texts
from workers.eagle_train.dense import features, greedy_continuations
from workers.eagle_train.train import EagleRecipe, most_frequent_outputs, train_eagle
from workers.models.loader import load_model

TINY_RECIPE = EagleRecipe(
    num_sequences=24, prompt_len=8, gen_len=12, gen_batch_size=12, num_steps=6, batch_size=4,
    learning_rate=1e-2, warmup_steps=2, ttt_steps=1,
)  # fmt: skip


@pytest.fixture(scope="module")
def trained_twice(eagle_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("trained-heads")
    for name in ("a", "b"):
        train_eagle(eagle_models["target"], training_texts(), root / name, TINY_RECIPE, show_progress=False)
    return root / "a", root / "b"


def test_training_is_deterministic_byte_for_byte(trained_twice) -> None:
    first, second = trained_twice
    for name in ("model.safetensors", "config.json"):
        assert (first / name).read_bytes() == (second / name).read_bytes()


def test_another_seed_gives_another_head(eagle_models, trained_twice, tmp_path) -> None:
    recipe = EagleRecipe(**{**TINY_RECIPE.__dict__, "seed": 1})
    train_eagle(eagle_models["target"], training_texts(), tmp_path / "c", recipe, show_progress=False)
    assert (tmp_path / "c" / "model.safetensors").read_bytes() != (trained_twice[0] / "model.safetensors").read_bytes()


def test_a_trained_head_serves_and_stays_exact(eagle_models, trained_twice) -> None:
    models = dict(eagle_models, trained=trained_twice[0])
    prompts = {str(i): (p, greedy(20)) for i, p in enumerate(make_prompts()[::5])}
    plain = run_all(spec_engine(models, draft=None, speculative_method="none"), prompts)
    engine = spec_engine(models, draft=None, eagle="trained", speculative_method="eagle", is_adaptive=False)
    outs = run_all(engine, prompts)
    assert {r: tokens(o) for r, o in outs.items()} == {r: tokens(o) for r, o in plain.items()}
    assert engine.speculator.stats.counts.num_steps > 0


def test_the_draft_vocabulary_is_the_most_generated_tokens() -> None:
    rows = torch.tensor([[9, 9, 5, 5, 5, 7], [9, 9, 7, 3, 5, 1]])  # prompt_len 2: the 9s are prompt tokens
    # generated: 5 x4, 7 x2, 3 and 1 once each (tie: the lower id first); never generated: by id
    assert most_frequent_outputs(rows, 2, 10, 3).tolist() == [1, 5, 7]
    assert most_frequent_outputs(rows, 2, 10, 5).tolist() == [0, 1, 3, 5, 7]
    with pytest.raises(ValueError, match="draft_vocab_size must be in"):
        most_frequent_outputs(rows, 2, 10, 11)


def test_a_head_trained_with_a_draft_vocabulary_keeps_it_and_stays_exact(eagle_models, tmp_path) -> None:
    recipe = EagleRecipe(**{**TINY_RECIPE.__dict__, "draft_vocab_size": 64})
    for name in ("a", "b"):
        record = train_eagle(eagle_models["target"], training_texts(), tmp_path / name, recipe, show_progress=False)
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == (tmp_path / "b" / "model.safetensors").read_bytes()
    assert 0 < record["draft_vocab_coverage"] <= 1
    saved = load_file(str(tmp_path / "a" / "model.safetensors"))
    assert saved.pop("draft_vocab").shape == (64,)
    assert record["num_trainable_params"] == sum(v.numel() for v in saved.values())  # fc and the layer only
    models = dict(eagle_models, trained=tmp_path / "a")
    prompts = {str(i): (p, greedy(20)) for i, p in enumerate(make_prompts()[::5])}
    plain = run_all(spec_engine(models, draft=None, speculative_method="none"), prompts)
    engine = spec_engine(models, draft=None, eagle="trained", speculative_method="eagle", is_adaptive=False)
    assert engine.speculator.eagle.runner.head.draft_vocab.numel() == 64
    outs = run_all(engine, prompts)
    assert {r: tokens(o) for r, o in outs.items()} == {r: tokens(o) for r, o in plain.items()}


def test_a_draft_vocabulary_larger_than_the_target_is_refused_before_training(eagle_models, tmp_path) -> None:
    recipe = EagleRecipe(**{**TINY_RECIPE.__dict__, "draft_vocab_size": 513})
    with pytest.raises(ValueError, match="larger than the target's vocabulary \\(512\\)"):
        train_eagle(eagle_models["target"], training_texts(), tmp_path / "h", recipe, show_progress=False)
    assert not (tmp_path / "h").exists()


def test_generation_keeps_the_features_a_full_pass_computes(eagle_models) -> None:
    """The features kept while generating equal a full causal pass over the finished rows."""
    model = load_model(eagle_models["target"], torch.float64)
    prompts = torch.randint(1, 500, (3, 5), generator=torch.Generator().manual_seed(0))
    rows, kept = greedy_continuations(model, prompts, 6)  # [3, 10], [3, 10, hidden]
    assert rows.shape == (3, 10) and torch.equal(rows[:, :5], prompts)
    torch.testing.assert_close(kept, features(model, rows))


def test_cli_train_eagle_writes_a_head(eagle_models, tmp_path) -> None:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(training_texts()))
    out = tmp_path / "head"
    args = ["models", "train-eagle", "--target", str(eagle_models["target"]), "--corpus", str(corpus),
            "--out", str(out), "--steps", "2", "--num-sequences", "8", "--prompt-len", "8", "--gen-len", "6",
            "--batch-size", "4", "--draft-vocab-size", "32"]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert (out / "model.safetensors").is_file() and "num_trainable_params" in result.output
    assert "draft_vocab_coverage" in result.output
    assert json.loads((out / "config.json").read_text())["draft_vocab_size"] == 32


def test_cli_train_eagle_refuses_a_missing_corpus(eagle_models, tmp_path) -> None:
    args = ["models", "train-eagle", "--target", str(eagle_models["target"]), "--corpus", str(tmp_path / "nope"),
            "--out", str(tmp_path / "head")]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2 and "not a file" in result.output
