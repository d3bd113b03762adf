"""The demo pair as the default model: fill an EngineConfig's missing model dirs with the demo pair's.

Called by whoever builds an engine from configuration (the CLI's worker and generate, the benchmarks), so
the engine itself never imports the demo builder. Builds the pair on first use (minutes), then reads the cache.
"""

import dataclasses

from workers.engine.config import EngineConfig


def with_demo_pair(cfg: EngineConfig) -> EngineConfig:
    """cfg unchanged when it names a target; else the demo pair's target (and draft, unless cfg names one)."""
    if cfg.target_dir is not None:
        return cfg
    from workers.demo.build import ensure_demo_pair

    pair = ensure_demo_pair()
    return dataclasses.replace(
        cfg, target_dir=str(pair.target_dir), draft_dir=cfg.draft_dir or str(pair.draft_dir)
    )
