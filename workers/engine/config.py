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
    num_threads: int = 0  # torch intra-op threads for large passes; 0 = every core this process may use
    single_thread_max_tokens: int = 4  # passes of at most this many tokens run on one thread
    block_size: int = 16  # tokens per KV block
    kv_cache_mb: float = 256.0  # KV budget for target + draft caches
    max_num_seqs: int = 32  # sequences running at once
    max_num_batched_tokens: int = 512  # tokens per forward (prefill chunks + decodes)
    max_model_len: int = 0  # 0 = the target's max_position_embeddings
    seed: int = 0  # seeds the RNG that unseeded sampling requests draw their generators from
    # speculative decoding (workers/spec/)
    speculative_method: str = "none"  # draft | ngram | none: the default for requests that do not choose
    num_speculative_tokens: int = 4  # k at most (chain); the adaptive controller moves each sequence's k in [k_min, k]
    speculative_k_min: int = 1
    is_adaptive: bool = True  # False: every speculating sequence uses num_speculative_tokens
    tree_size: int = 0  # > 0: the draft model proposes a token tree of up to tree_size nodes instead of a chain
    tree_branching: int = 2  # children per tree node at most
    ngram_min_n: int = 1
    ngram_max_n: int = 4
    spec_batch_token_budget: int = 64  # tokens per target pass before speculation stops paying (compute-bound)
    spec_max_batch_size: int = 16  # more decoding sequences than this: nobody speculates
    spec_draft_cost_per_token: float = 0.15  # one more draft token's cost, in target decode steps
    spec_fallback_acceptance: float = 0.15  # acceptance below this for `patience` steps: plain decoding
    spec_fallback_patience_steps: int = 16

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.max_num_seqs < 1:
            raise ValueError("block_size and max_num_seqs must be >= 1")
        if self.kv_cache_mb <= 0:
            raise ValueError("kv_cache_mb must be > 0")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        if self.max_model_len < 0 or self.num_threads < 0 or self.single_thread_max_tokens < 0:
            raise ValueError("max_model_len, num_threads and single_thread_max_tokens must be >= 0")
        if self.speculative_method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_method must be one of {SPECULATIVE_METHODS}")
        if not 1 <= self.speculative_k_min <= self.num_speculative_tokens:
            raise ValueError("need 1 <= speculative_k_min <= num_speculative_tokens")
        if self.tree_size < 0 or self.tree_branching < 1:
            raise ValueError("tree_size must be >= 0 and tree_branching >= 1")
        if not 1 <= self.ngram_min_n <= self.ngram_max_n:
            raise ValueError("need 1 <= ngram_min_n <= ngram_max_n")

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
    if type_name == "bool":
        return text.lower() in ("1", "true", "yes", "on")
    if "int" in type_name and "None" not in type_name:
        return int(text)
    if "float" in type_name:
        return float(text)
    return text or None
