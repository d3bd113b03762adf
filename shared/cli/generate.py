"""`specfleet generate PROMPT`: the engine in-process on one prompt (no Redis, no gateway)."""

import json
import sys
import time
from typing import Annotated

import typer

from shared.speculation import SpeculativeMethod


def generate(
    prompt: Annotated[str, typer.Argument(help="Prompt text")],
    target: Annotated[str | None, typer.Option(help="Target model dir (HF layout); default: the demo pair")] = None,
    draft: Annotated[str | None, typer.Option(help="Draft model dir; default: the demo pair's draft")] = None,
    eagle: Annotated[
        str | None, typer.Option(help="EAGLE head dir (train-eagle); default: the demo target's head")
    ] = None,
    max_tokens: Annotated[int, typer.Option(help="Tokens to generate at most")] = 128,
    temperature: Annotated[float, typer.Option(help="0 = greedy")] = 0.0,
    top_p: Annotated[float, typer.Option()] = 1.0,
    seed: Annotated[int | None, typer.Option()] = None,
    speculative: Annotated[
        SpeculativeMethod | None, typer.Option(help="none | draft | ngram | eagle (default: the engine's speculative_method; unset: eagle with a head, else draft, else ngram)")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of streaming")] = False,
    tensor_parallel_size: Annotated[
        int | None, typer.Option(help="Shard the target over N ranks (processes); default: the engine config")
    ] = None,
    device: Annotated[
        str | None, typer.Option(help="auto | cpu | cuda | cuda:N (default: the engine config's, auto)")
    ] = None,
) -> None:
    """Run the engine in-process on one prompt; stream the text and print a stats line."""
    from workers.demo.resolve import with_demo_pair
    from workers.engine.config import EngineConfig
    from workers.engine.engine import Engine
    from workers.engine.errors import InvalidRequestError
    from workers.engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed,
                            speculative=speculative)
    try:
        params.validate()  # before the engine loads (seconds): a bad option is refused at once
    except InvalidRequestError as exc:
        typer.echo(f"error: {exc.field}: {exc.message}", err=True)
        raise typer.Exit(2) from exc
    try:
        cfg = EngineConfig.load(target_dir=target, draft_dir=draft, eagle_dir=eagle,
                                tensor_parallel_size=tensor_parallel_size, device=device)
        # with TP > 1 the other ranks stop when the engine is collected or this process exits (Engine.close)
        engine = Engine.from_config(with_demo_pair(cfg))
    except ValueError as exc:  # a setting the engine cannot start with (pydantic's errors name the field)
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
    try:
        engine.add_request("cli", prompt, params)
    except InvalidRequestError as exc:
        typer.echo(f"error: {exc.field}: {exc.message}", err=True)
        raise typer.Exit(2) from exc
    text, token_ids, finish_reason, metrics = [], [], None, {}
    start = time.perf_counter()
    while engine.num_unfinished():
        for out in engine.step():
            text.append(out.new_text)
            token_ids.extend(out.new_token_ids)
            if not as_json:
                sys.stdout.write(out.new_text)
                sys.stdout.flush()
            if out.finished:
                finish_reason, metrics = out.finish_reason, out.metrics
    elapsed_s = time.perf_counter() - start
    metrics = {**metrics, "tokens_per_s": len(token_ids) / elapsed_s if elapsed_s > 0 else 0.0}
    if as_json:
        typer.echo(json.dumps({"text": "".join(text), "token_ids": token_ids, "finish_reason": finish_reason,
                               "metrics": metrics}))
        return
    stats = (f"[{len(token_ids)} tokens in {elapsed_s:.2f} s, {metrics['tokens_per_s']:.1f} tok/s, "
             f"ttft {metrics.get('ttft_ms', 0.0):.1f} ms, finish {finish_reason}]")
    typer.echo("\n" + stats, err=True)


def register(app: typer.Typer) -> None:
    """Add this module's command to `app`."""
    app.command()(generate)
