"""The demo pair as the default model: fill an EngineConfig's missing model dirs with the demo pair's.

Called by whoever builds an engine from configuration (the CLI's worker and generate, the benchmarks), so
the engine itself never imports the demo builder. Builds the pair and its EAGLE head on first use (minutes),
then reads the cache.
"""

import dataclasses

from workers.engine.config import EngineConfig


def with_demo_pair(cfg: EngineConfig) -> EngineConfig:
    """cfg unchanged when it names a target; else the demo pair's target (and draft, and the demo target's
    EAGLE head, unless cfg names them)."""
    if cfg.target_dir is not None:
        return cfg
    from workers.demo import build, eagle_build

    pair = build.ensure_demo_pair()
    return dataclasses.replace(
        cfg,
        target_dir=str(pair.target_dir),
        draft_dir=cfg.draft_dir or str(pair.draft_dir),
        eagle_dir=cfg.eagle_dir or str(eagle_build.ensure_demo_head(pair)),
    )
