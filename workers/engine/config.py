"""EngineConfig: the engine's settings, from configs/engine.yaml, SPECFLEET_ENGINE_* env vars and overrides."""

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

DEFAULT_PATH = Path(__file__).resolve().parents[2] / "configs" / "engine.yaml"
ENV_PREFIX = "SPECFLEET_ENGINE_"
SPECULATIVE_METHODS = ("draft", "ngram", "none")


@dataclass(frozen=True)
class EngineConfig:
    target_dir: str | None = None  # HF checkpoint dir; None = the demo pair (built if missing)
    draft_dir: str | None = None  # None = the demo pair's draft when target_dir is None
    dtype: str = "auto"  # auto (bf16 where the CPU/GPU does it fast, else fp32) | float32 | bfloat16 | float16 | float64
    num_threads: int = 0  # torch intra-op threads; 0 = leave torch's default
    block_size: int = 16  # tokens per KV block
    kv_cache_mb: float = 256.0  # KV budget for target + draft caches
    max_num_seqs: int = 32  # sequences running at once
    max_num_batched_tokens: int = 512  # tokens per forward (prefill chunks + decodes)
    max_model_len: int = 0  # 0 = the target's max_position_embeddings
    seed: int = 0  # seeds the RNG that unseeded sampling requests draw their generators from
    speculative_method: str = "none"  # draft | ngram | none
    num_speculative_tokens: int = 4

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.max_num_seqs < 1:
            raise ValueError("block_size and max_num_seqs must be >= 1")
        if self.kv_cache_mb <= 0:
            raise ValueError("kv_cache_mb must be > 0")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        if self.max_model_len < 0 or self.num_threads < 0:
            raise ValueError("max_model_len and num_threads must be >= 0")
        if self.speculative_method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_method must be one of {SPECULATIVE_METHODS}")
        if self.num_speculative_tokens < 1:
            raise ValueError("num_speculative_tokens must be >= 1")

    @classmethod
    def load(cls, path: str | Path | None = None, **overrides: Any) -> "EngineConfig":
        """File values, then SPECFLEET_ENGINE_<FIELD> environment variables, then explicit overrides."""
        path = Path(path) if path is not None else DEFAULT_PATH
        values: dict[str, Any] = {}
        if path.exists():
            values.update((yaml.safe_load(path.read_text()) or {}).get("engine", {}) or {})
        types = {f.name: f.type for f in dataclasses.fields(cls)}
        for name in types:
            env = os.environ.get(ENV_PREFIX + name.upper())
            if env is not None:
                values[name] = _parse_env(env, str(types[name]))
        values.update({k: v for k, v in overrides.items() if v is not None})
        unknown = set(values) - set(types)
        if unknown:
            raise ValueError(f"unknown engine settings: {sorted(unknown)}")
        return cls(**values)


def _parse_env(text: str, type_name: str) -> Any:
    if "int" in type_name and "None" not in type_name:
        return int(text)
    if "float" in type_name:
        return float(text)
    return text or None
