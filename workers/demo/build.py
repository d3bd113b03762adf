"""The offline demo model pair: build it once, deterministically, into the specfleet cache.

`ensure_demo_pair()` returns the pair's two Hugging Face directories, building them first if missing:
    $SPECFLEET_HOME/models/<recipe name>/target/   config.json, model.safetensors, generation_config.json,
    $SPECFLEET_HOME/models/<recipe name>/draft/    tokenizer.json, tokenizer_config.json, special_tokens_map.json
    $SPECFLEET_HOME/models/<recipe name>/build.json   the recipe and the build's measurements (written last)
The pair is built in a temporary sibling directory and renamed into place, so a killed build never leaves
a half pair; a file lock makes concurrent callers wait for one build instead of racing.
"""

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import logging
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from shared.home import specfleet_home
from workers.demo.corpus import corpus_files, read_source, split_corpus
from workers.demo.tokenizer import EOS_TOKEN_ID, encode_documents, save_tokenizer, train_tokenizer
from workers.demo.train import (
    ModelRecipe,
    eval_loss,
    grow_depth,
    llama_config,
    new_model,
    train_steps,
)
from workers.models.threads import pinned_threads

logger = logging.getLogger(__name__)

BUILD_MARKER = "build.json"


@dataclass(frozen=True)
class DemoRecipe:
    """Everything that determines the pair's bytes (with the code, torch version and thread count).

    `name` is the pair's directory name: bump its version whenever the recipe or the build code changes
    the output, so caches rebuild (tests pin `fingerprint()` to catch a forgotten bump).
    """

    name: str
    vocab_size: int
    target: ModelRecipe
    draft: ModelRecipe
    seed: int = 0
    num_threads: int = 2
    max_position_embeddings: int = 2048
    max_files: int | None = None  # use only the first N corpus files (small recipes for tests)
    # depth up-scaling: after `target`'s steps the target grows to `target_growth.num_layers` layers (same
    # function, see train.grow_depth) and trains `target_growth.num_steps` more; None = no growth
    target_growth: ModelRecipe | None = None

    def __post_init__(self) -> None:
        growth = self.target_growth
        if growth is None:
            return
        same_width = (growth.hidden_size, growth.num_heads, growth.intermediate_size) == (
            self.target.hidden_size,
            self.target.num_heads,
            self.target.intermediate_size,
        )
        if (
            not same_width
            or growth.num_layers % self.target.num_layers
            or growth.num_layers <= self.target.num_layers
        ):
            raise ValueError(
                f"target_growth must deepen the target by a whole factor at the same width: {growth}"
            )

    @property
    def target_num_steps(self) -> int:
        return self.target.num_steps + (self.target_growth.num_steps if self.target_growth else 0)

    def fingerprint(self) -> str:
        """A short hash of the recipe's values."""
        encoded = json.dumps(dataclasses.asdict(self), sort_keys=True).encode()
        return hashlib.sha256(encoded).hexdigest()[:12]


# demo-v3: the demo-v2 pair (4L/256 target, 1L/128 draft; DEMO_PAIR.md has how it was chosen) with the
# target grown to 12 layers for its last steps (train.grow_depth): a 12-layer forward costs ~8x the
# draft's here, the regime where a draft pays off, and growing costs far less than training 12 layers.
DEMO_RECIPE = DemoRecipe(
    name="demo-v3",
    vocab_size=4096,
    target=ModelRecipe(
        num_layers=4, hidden_size=256, num_heads=4, intermediate_size=640,
        num_steps=200, learning_rate=3e-3, warmup_steps=25,
    ),
    target_growth=ModelRecipe(
        num_layers=12, hidden_size=256, num_heads=4, intermediate_size=640,
        num_steps=32, learning_rate=1.5e-3, warmup_steps=4,
    ),
    draft=ModelRecipe(
        num_layers=1, hidden_size=128, num_heads=2, intermediate_size=320,
        num_steps=450, learning_rate=5e-3, warmup_steps=40,
    ),
)  # fmt: skip


@dataclass(frozen=True)
class DemoPair:
    """The two model directories of a built pair (Hugging Face layout, same tokenizer in each)."""

    target_dir: Path
    draft_dir: Path


def pair_dir(home: Path | None = None, recipe: DemoRecipe = DEMO_RECIPE) -> Path:
    return specfleet_home(home) / "models" / recipe.name


def _pair_in(directory: Path) -> DemoPair:
    return DemoPair(target_dir=directory / "target", draft_dir=directory / "draft")


def find_demo_pair(home: Path | None = None, recipe: DemoRecipe = DEMO_RECIPE) -> DemoPair | None:
    """The built pair, or None if it is not (completely) built or was built from another recipe."""
    directory = pair_dir(home, recipe)
    marker = directory / BUILD_MARKER
    if not marker.is_file():
        return None
    fingerprint = json.loads(marker.read_text()).get("fingerprint")
    if fingerprint != recipe.fingerprint():
        logger.warning(
            "%s was built from recipe %s, not %s: it will be rebuilt",
            directory,
            fingerprint,
            recipe.fingerprint(),
        )
        return None
    return _pair_in(directory)


def build_record(pair: DemoPair) -> dict[str, Any]:
    """The record `build_pair` wrote next to the pair's two directories (recipe, times, losses)."""
    record: dict[str, Any] = json.loads((pair.target_dir.parent / BUILD_MARKER).read_text())
    return record


def ensure_demo_pair(
    home: Path | None = None, force: bool = False, recipe: DemoRecipe = DEMO_RECIPE
) -> DemoPair:
    """The demo pair's directories, building the pair first if it is missing (or if `force`)."""
    directory = pair_dir(home, recipe)
    if not force and (pair := find_demo_pair(home, recipe)) is not None:
        return pair
    directory.parent.mkdir(parents=True, exist_ok=True)
    with _build_lock(directory):
        if not force and (pair := find_demo_pair(home, recipe)) is not None:
            logger.info("demo pair built by another process meanwhile: %s", directory)
            return pair
        _remove_stale_builds(directory)
        build_dir = Path(tempfile.mkdtemp(prefix=f".{recipe.name}.building-", dir=directory.parent))
        try:
            build_pair(recipe, build_dir)
            _move_into_place(build_dir, directory)
        except BaseException:
            shutil.rmtree(build_dir, ignore_errors=True)
            raise
    logger.info("demo pair ready: %s", directory)
    return _pair_in(directory)


@contextlib.contextmanager
def _build_lock(directory: Path) -> Iterator[None]:
    """An exclusive lock on `<models>/.<name>.lock`, held while building (released if the process dies)."""
    with open(directory.parent / f".{directory.name}.lock", "w") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)


@contextlib.contextmanager
def _quiet_transformers_progress() -> Iterator[None]:
    from transformers.utils import logging as transformers_logging

    was_enabled = transformers_logging.is_progress_bar_enabled()
    transformers_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            transformers_logging.enable_progress_bar()


def _remove_stale_builds(directory: Path) -> None:
    """Delete what killed builds left behind (only called under the build lock)."""
    for stale in directory.parent.glob(f".{directory.name}.*-*"):
        logger.info("removing leftover %s", stale)
        shutil.rmtree(stale, ignore_errors=True)


def _move_into_place(build_dir: Path, directory: Path) -> None:
    """Rename the finished build to `directory`; an old pair (forced rebuild) is moved aside first."""
    for path in (build_dir, *build_dir.rglob("*")):  # mkdtemp and some writers create owner-only modes
        path.chmod(0o755 if path.is_dir() else 0o644)
    if directory.exists():
        old_dir = Path(tempfile.mkdtemp(prefix=f".{directory.name}.old-", dir=directory.parent))
        directory.rename(old_dir / directory.name)
        build_dir.rename(directory)
        shutil.rmtree(old_dir, ignore_errors=True)
    else:
        build_dir.rename(directory)


def build_pair(recipe: DemoRecipe, out_dir: Path) -> dict[str, object]:
    """Build the pair into `out_dir` (`target/`, `draft/`, then `build.json`); return the build record."""
    start_s = time.perf_counter()
    split = split_corpus(corpus_files(), max_files=recipe.max_files)
    train_texts = [read_source(path) for path in split.train_files]
    held_out_texts = [read_source(path) for path in split.held_out_files]
    tokenizer = train_tokenizer(train_texts, recipe.vocab_size)
    train_ids = torch.tensor(encode_documents(tokenizer, train_texts))  # [num_train_tokens]
    held_out_ids = torch.tensor(encode_documents(tokenizer, held_out_texts))  # [num_held_out_tokens]
    logger.info("corpus: %d train tokens, %d held-out tokens", train_ids.numel(), held_out_ids.numel())
    models: dict[str, dict[str, object]] = {}
    num_steps = recipe.target_num_steps + recipe.draft.num_steps
    with (
        pinned_threads(recipe.num_threads),
        tqdm(
            total=num_steps, desc=f"building {recipe.name}", unit="step", file=sys.stderr, dynamic_ncols=True
        ) as progress,
    ):
        for role, model_recipe, init_seed in (
            ("target", recipe.target, recipe.seed),
            ("draft", recipe.draft, recipe.seed + 1),
        ):
            model_dir = out_dir / role
            models[role] = _build_model(
                role, model_recipe, recipe, init_seed, train_ids, held_out_ids, progress, model_dir
            )
            save_tokenizer(tokenizer, model_dir, recipe.max_position_embeddings)
    build_time_s = time.perf_counter() - start_s
    record: dict[str, object] = {
        "name": recipe.name,
        "fingerprint": recipe.fingerprint(),
        "recipe": dataclasses.asdict(recipe),
        "build_time_s": round(build_time_s, 1),
        "models": models,
        "corpus": {
            "train_files": [path.name for path in split.train_files],
            "held_out_files": [path.name for path in split.held_out_files],
            "num_train_tokens": train_ids.numel(),
            "num_held_out_tokens": held_out_ids.numel(),
        },
        "python": platform.python_version(),
        "torch": torch.__version__,
    }
    (out_dir / BUILD_MARKER).write_text(json.dumps(record, indent=2) + "\n")
    logger.info("built %s in %.1f s", recipe.name, build_time_s)
    return record


def _build_model(
    role: str,
    model_recipe: ModelRecipe,
    recipe: DemoRecipe,
    init_seed: int,
    train_ids: torch.Tensor,
    held_out_ids: torch.Tensor,
    progress: tqdm,
    model_dir: Path,
) -> dict[str, object]:
    """Train one model, save it (fp32) into `<out>/<role>` and return its record."""
    start_s = time.perf_counter()
    config = llama_config(model_recipe, recipe.vocab_size, EOS_TOKEN_ID, recipe.max_position_embeddings)

    def on_step(step: int, loss: float) -> None:
        progress.update(1)
        if step % 10 == 0:
            progress.set_postfix_str(f"{role} loss {loss:.2f}", refresh=False)

    generator = torch.Generator().manual_seed(recipe.seed)  # both models draw the same batches in order
    model = new_model(config, init_seed)
    train_steps(model, model_recipe, train_ids, generator, on_step)
    growth = recipe.target_growth if role == "target" else None
    grown_from: dict[str, object] = {}
    if growth is not None:
        grown_from = {
            "num_layers": model_recipe.num_layers,
            "held_out_loss": round(eval_loss(model, held_out_ids, model_recipe.seq_len), 4),
        }
        model = grow_depth(model, growth.num_layers)
        train_steps(model, growth, train_ids, generator, on_step)
    train_time_s = time.perf_counter() - start_s
    val_loss = eval_loss(model, held_out_ids, model_recipe.seq_len)
    logger.info("%s: trained in %.1f s, held-out loss %.3f", role, train_time_s, val_loss)
    with _quiet_transformers_progress():  # one bar (ours) per build
        model.save_pretrained(str(model_dir))
    return {
        "num_params": sum(p.numel() for p in model.parameters()),
        "train_time_s": round(train_time_s, 1),
        "held_out_loss": round(val_loss, 4),
        **({"grown_from": grown_from} if grown_from else {}),
    }
