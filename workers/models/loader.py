"""Load a Hugging Face checkpoint directory (config.json + *.safetensors, sharded or not) into LlamaModel."""

import json
import logging
from pathlib import Path

import torch
from safetensors.torch import load_file

from workers.models.config import ModelConfig
from workers.models.llama import LlamaModel

log = logging.getLogger(__name__)

DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
}


def resolve_dtype(name: str) -> torch.dtype:
    """'auto' = bfloat16 where the CPU has fast bf16 matmuls (AVX-512 / AMX), else float32."""
    if name == "auto":
        if torch.cuda.is_available():
            return torch.bfloat16
        capability = torch.backends.cpu.get_cpu_capability()
        return torch.bfloat16 if capability.startswith(("AVX512", "AMX")) else torch.float32
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose auto or one of {sorted(DTYPES)}")
    return DTYPES[name]


def check_checkpoint_dir(model_dir: str | Path, role: str) -> None:
    """ValueError naming the directory and what it lacks, before anything loads (the tokenizer's loader read a
    missing path as a hub repo id, and a directory without tokenizer files as a slow tokenizer to convert)."""
    path = Path(model_dir)
    layout = "a Hugging Face checkpoint directory: config.json, *.safetensors, tokenizer files"
    if not path.is_dir():
        raise ValueError(f"the {role} {path}: no such directory ({layout})")
    if not (path / "config.json").is_file():
        raise ValueError(f"the {role} {path} has no config.json ({layout})")
    if not any(path.glob("*.safetensors")):
        raise ValueError(f"the {role} {path} has no *.safetensors ({layout})")


def checkpoint_files(model_dir: Path) -> list[str]:
    """The checkpoint's *.safetensors file names (the index's, when the checkpoint is sharded)."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    return files


def read_checkpoint(model_dir: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for name in checkpoint_files(model_dir):
        tensors.update(load_file(str(model_dir / name)))
    return tensors


def load_model(
    model_dir: str | Path, dtype: torch.dtype, max_len: int | None = None, device: torch.device | None = None
) -> LlamaModel:
    """The checkpoint as a LlamaModel in `dtype`, on `device` (None = the CPU), for inference."""
    model_dir = Path(model_dir)
    cfg = ModelConfig.from_dir(model_dir)
    model_len = max_len or cfg.max_position_embeddings
    with torch.device("meta"):
        model = LlamaModel(cfg)
    raw = {k.removeprefix("model."): v for k, v in read_checkpoint(model_dir).items()}
    state = _our_state_dict(cfg, raw)
    model = model.to_empty(device="cpu")
    model.load_state_dict(state, strict=True, assign=True)
    model = model.to(dtype=dtype, device=device)
    if state["lm_head.weight"] is state["embed.weight"]:  # tied: .to() converts each parameter on its own
        model.lm_head.weight = model.embed.weight  # one matrix again, not a converted copy each
    model.init_rope(model_len)
    model.eval().requires_grad_(False)
    log.info("loaded %s (%s, %d layers, %.2fM params, %s, %s)", model_dir, cfg.model_type, cfg.num_layers,
             sum(p.numel() for p in model.parameters()) / 1e6, dtype, model.embed.weight.device)
    return model


def _our_state_dict(cfg: ModelConfig, raw: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename HF tensors to ours, fusing q/k/v and gate/up."""
    out = {"embed.weight": raw["embed_tokens.weight"], "norm.weight": raw["norm.weight"]}
    head = raw.get("lm_head.weight")
    out["lm_head.weight"] = raw["embed_tokens.weight"] if head is None or cfg.tie_word_embeddings else head
    for i in range(cfg.num_layers):
        src, dst = f"layers.{i}.", f"layers.{i}."
        attn, mlp = src + "self_attn.", src + "mlp."
        out[dst + "input_norm.weight"] = raw[src + "input_layernorm.weight"]
        out[dst + "post_norm.weight"] = raw[src + "post_attention_layernorm.weight"]
        out[dst + "qkv.weight"] = torch.cat([raw[attn + f"{p}_proj.weight"] for p in "qkv"])
        if cfg.qkv_bias:
            out[dst + "qkv.bias"] = torch.cat([raw[attn + f"{p}_proj.bias"] for p in "qkv"])
        out[dst + "o_proj.weight"] = raw[attn + "o_proj.weight"]
        if cfg.o_bias:
            out[dst + "o_proj.bias"] = raw[attn + "o_proj.bias"]
        out[dst + "gate_up.weight"] = torch.cat([raw[mlp + "gate_proj.weight"], raw[mlp + "up_proj.weight"]])
        out[dst + "down.weight"] = raw[mlp + "down_proj.weight"]
        if cfg.mlp_bias:
            out[dst + "gate_up.bias"] = torch.cat([raw[mlp + "gate_proj.bias"], raw[mlp + "up_proj.bias"]])
            out[dst + "down.bias"] = raw[mlp + "down_proj.bias"]
    return out


def load_tokenizer(model_dir: str | Path):  # -> transformers.PreTrainedTokenizerBase
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))
