"""ModelConfig: the subset of a Hugging Face config.json our Llama-family model code needs."""

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral")


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None  # {"rope_type": "linear" | "llama3", ...} or None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    sliding_window: int | None  # Mistral-style local attention, None = full
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "ModelConfig":
        path = Path(model_dir) / "config.json"
        raw = json.loads(path.read_text())
        return cls.from_dict(raw, extra_eos=_generation_eos(Path(model_dir)))

    @classmethod
    def from_dict(cls, raw: dict[str, Any], extra_eos: tuple[int, ...] = ()) -> "ModelConfig":
        model_type = raw.get("model_type", "llama")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"unsupported model_type {model_type!r}; supported: {SUPPORTED_MODEL_TYPES}")
        if raw.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {raw.get('hidden_act')!r}")
        num_heads = int(raw["num_attention_heads"])
        rope = _rope_settings(raw)
        attention_bias = bool(raw.get("attention_bias", False))
        sliding_window = raw.get("sliding_window")
        if model_type == "qwen2" and not raw.get("use_sliding_window", False):
            sliding_window = None
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos if isinstance(eos, list) else ([] if eos is None else [eos]))
        return cls(
            model_type=model_type,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=int(raw["hidden_size"]),
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
            head_dim=int(raw.get("head_dim") or raw["hidden_size"] // num_heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", 10000.0)),
            rope_scaling=rope if rope.get("rope_type", "default") != "default" else None,
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or attention_bias,
            o_bias=model_type == "llama" and attention_bias,
            mlp_bias=bool(raw.get("mlp_bias", False)),
            sliding_window=int(sliding_window) if sliding_window else None,
            eos_token_ids=tuple(dict.fromkeys([*eos_ids, *extra_eos])),
        )


def _rope_settings(raw: dict[str, Any]) -> dict[str, Any]:
    """transformers 5 writes `rope_parameters`; older configs write `rope_theta` + `rope_scaling`."""
    params = dict(raw.get("rope_parameters") or {})
    scaling = raw.get("rope_scaling") or {}
    merged = {**scaling, **params}
    if "rope_theta" not in merged and "rope_theta" in raw:
        merged["rope_theta"] = raw["rope_theta"]
    if "type" in merged and "rope_type" not in merged:
        merged["rope_type"] = merged["type"]
    return merged


def _generation_eos(model_dir: Path) -> tuple[int, ...]:
    path = model_dir / "generation_config.json"
    if not path.exists():
        return ()
    eos = json.loads(path.read_text()).get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)
