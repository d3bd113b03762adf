"""`specfleet models ...`: the offline demo pair (workers/demo/) and EAGLE heads (workers/eagle_train/).

`specfleet models build-demo [--force] [--home DIR]`, `specfleet models path [--home DIR]`,
`specfleet models measure-demo [--home DIR]` and `specfleet models train-eagle --target DIR --corpus FILE
--out DIR [--seed N] [--steps N] ...`. torch and transformers are imported inside the commands.
"""

import json
from pathlib import Path
from typing import Annotated

import typer

models_app = typer.Typer(no_args_is_help=True, help="Model pairs: the offline, deterministic demo pair.")

HomeOption = Annotated[
    Path | None, typer.Option("--home", help="Cache root (default: $SPECFLEET_HOME or ~/.cache/specfleet).")
]


@models_app.command("build-demo")
def build_demo(
    force: Annotated[
        bool, typer.Option("--force", help="Rebuild even if the pair is already built.")
    ] = False,
    home: HomeOption = None,
) -> None:
    """Build the demo target/draft pair, then the target's EAGLE head (each skipped when already built), and
    print their directories. --force rebuilds both."""
    from workers.demo.build import build_record, ensure_demo_pair, find_demo_pair
    from workers.demo.eagle_build import ensure_demo_head, find_demo_head

    was_built = not force and find_demo_pair(home) is not None
    pair = ensure_demo_pair(home, force=force)
    record = build_record(pair)
    typer.echo(f"target: {pair.target_dir}")
    typer.echo(f"draft: {pair.draft_dir}")
    suffix = " (already built; nothing to do)" if was_built else ""
    typer.echo(f"build_time_s: {record['build_time_s']}{suffix}")
    head_was_built = not force and find_demo_head(home) is not None
    head = ensure_demo_head(pair, home, force=force)
    head_record = json.loads((head / "build.json").read_text())
    typer.echo(f"eagle: {head}")
    suffix = " (already built; nothing to do)" if head_was_built else ""
    typer.echo(f"eagle_build_time_s: {head_record['build_time_s']}{suffix}")


@models_app.command("path")
def path(home: HomeOption = None) -> None:
    """Print the demo pair's directories; exit 1 if it is not built."""
    from workers.demo.build import find_demo_pair, pair_dir

    pair = find_demo_pair(home)
    if pair is None:
        typer.echo(
            f"demo pair not built (expected at {pair_dir(home)}); run `specfleet models build-demo`", err=True
        )
        raise typer.Exit(code=1)
    typer.echo(f"target: {pair.target_dir}")
    typer.echo(f"draft: {pair.draft_dir}")


@models_app.command("measure-demo")
def measure_demo(
    home: HomeOption = None,
    num_prompts: Annotated[int, typer.Option(help="Held-out prompts for the agreement figure.")] = 24,
    max_new_tokens: Annotated[int, typer.Option(help="Target greedy tokens per prompt.")] = 64,
    num_threads: Annotated[int, typer.Option(help="torch threads while measuring.")] = 2,
    json_path: Annotated[Path | None, typer.Option("--json", help="Also write the figures here.")] = None,
) -> None:
    """Measure the built pair: sizes, forward cost (ms) of target vs draft, greedy agreement."""
    from workers.demo.build import find_demo_pair
    from workers.demo.measure import measure_pair

    pair = find_demo_pair(home)
    if pair is None:
        typer.echo("demo pair not built; run `specfleet models build-demo`", err=True)
        raise typer.Exit(code=1)
    figures = measure_pair(
        pair, num_prompts=num_prompts, max_new_tokens=max_new_tokens, num_threads=num_threads
    )
    for key, value in figures.items():
        typer.echo(f"{key}: {value}")
    if json_path is not None:
        json_path.write_text(json.dumps(figures, indent=2) + "\n")


@models_app.command("train-eagle")
def train_eagle(
    target: Annotated[Path, typer.Option("--target", help="The target's checkpoint dir (Llama, Qwen2, Mistral).")],
    corpus: Annotated[Path, typer.Option("--corpus", help="A UTF-8 text file the training windows come from.")],
    out: Annotated[Path, typer.Option("--out", help="Where the head goes (config.json, model.safetensors).")],
    seed: Annotated[int, typer.Option(help="Seeds the windows, the init and the batches.")] = 0,
    steps: Annotated[int, typer.Option(help="Training steps (fixed: never a time budget).")] = 200,
    num_sequences: Annotated[int, typer.Option(help="Corpus windows the target continues.")] = 1024,
    prompt_len: Annotated[int, typer.Option(help="Corpus tokens per window.")] = 32,
    gen_len: Annotated[int, typer.Option(help="Greedy target tokens after each window.")] = 64,
    batch_size: Annotated[int, typer.Option(help="Rows per training step.")] = 16,
    learning_rate: Annotated[float, typer.Option(help="Peak learning rate (AdamW, cosine decay).")] = 3e-3,
    ttt_steps: Annotated[int, typer.Option(help="Training-time test: passes on the head's own features.")] = 1,
    num_threads: Annotated[int, typer.Option(help="torch threads (the result depends on it).")] = 1,
    draft_vocab_size: Annotated[
        int, typer.Option(help="Draft only the target's N most frequent output tokens (EAGLE-3); 0 = every token.")
    ] = 0,
) -> None:
    """Train an EAGLE draft head for TARGET on its own greedy continuations of CORPUS (deterministic)."""
    from workers.eagle_train.train import EagleRecipe
    from workers.eagle_train.train import train_eagle as run_training

    if not (target / "config.json").is_file():
        typer.echo(f"error: --target {target}: no config.json (not a checkpoint directory)", err=True)
        raise typer.Exit(code=2)
    if not corpus.is_file():
        typer.echo(f"error: --corpus {corpus}: not a file", err=True)
        raise typer.Exit(code=2)
    try:
        recipe = EagleRecipe(
            num_sequences=num_sequences, prompt_len=prompt_len, gen_len=gen_len, num_steps=steps,
            batch_size=batch_size, learning_rate=learning_rate, ttt_steps=ttt_steps, seed=seed,
            num_threads=num_threads, draft_vocab_size=draft_vocab_size,
        )  # fmt: skip
        record = run_training(target, [corpus.read_text(encoding="utf-8")], out, recipe)
    except ValueError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(code=2) from exc
    typer.echo(f"head: {out}")
    for key in ("num_trainable_params", "data_time_s", "train_time_s", "last_step", "draft_vocab_coverage"):
        if key in record:
            typer.echo(f"{key}: {record[key]}")


def register(app: typer.Typer) -> None:
    """Add this module's commands to `app`."""
    app.add_typer(models_app, name="models")
