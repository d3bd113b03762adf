"""Load one tensor-parallel rank's shard of a Hugging Face checkpoint: only its slices are read.

Each tensor is opened lazily (safetensors' `safe_open(...).get_slice`) and only the rows (column-parallel) or
columns (row-parallel) of this rank are read from the file, so no rank ever holds the full model. Names and
fusions follow loader.py (q/k/v into `qkv`, gate/up into `gate_up`), per rank.
"""

import logging
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from workers.models.config import ModelConfig
from workers.models.loader import checkpoint_files
from workers.models.sharded_llama import AllReduce, ShardedLlamaModel, resident_weight_bytes
from workers.models.sharding import Shard, local_config

log = logging.getLogger(__name__)


class _Checkpoint:
    """Lazy access to every tensor of a checkpoint directory, by its HF name (without `model.`)."""

    def __init__(self, model_dir: Path, stack: ExitStack) -> None:
        self._where: dict[str, tuple[Any, str]] = {}  # our name -> (the open file holding it, its key there)
        for name in checkpoint_files(model_dir):
            handle = stack.enter_context(safe_open(str(model_dir / name), framework="pt"))
            for key in handle.keys():
                self._where[key.removeprefix("model.")] = (handle, key)

    def has(self, name: str) -> bool:
        return name in self._where

    def full(self, name: str) -> torch.Tensor:
        handle, key = self._where[name]
        return handle.get_tensor(key)

    def rows(self, name: str, span: tuple[int, int]) -> torch.Tensor:  # [stop - start, ...]: part of dim 0
        handle, key = self._where[name]
        return handle.get_slice(key)[span[0] : span[1]]

    def columns(self, name: str, span: tuple[int, int]) -> torch.Tensor:  # [out, stop - start]: part of dim 1
        handle, key = self._where[name]
        return handle.get_slice(key)[:, span[0] : span[1]]


@contextmanager
def _open(model_dir: Path) -> Iterator[_Checkpoint]:
    with ExitStack() as stack:
        yield _Checkpoint(model_dir, stack)


def load_shard(
    model_dir: str | Path,
    dtype: torch.dtype,
    shard: Shard,
    all_reduce: AllReduce,
    max_len: int | None = None,
) -> ShardedLlamaModel:
    """Rank `shard.rank`'s model (the LM head on rank 0 only). Raises TensorParallelError when the size does
    not divide the model's heads, KV heads or MLP columns."""
    model_dir = Path(model_dir)
    cfg = ModelConfig.from_dir(model_dir)
    local = local_config(cfg, shard.world_size)
    has_head = shard.rank == 0
    with torch.device("meta"):
        model = ShardedLlamaModel(local, all_reduce, has_head)
    with _open(model_dir) as ckpt:
        state = _shard_state_dict(cfg, ckpt, shard, has_head)
    model = model.to_empty(device="cpu")
    state = {name: tensor.to(dtype) for name, tensor in state.items()}
    if has_head and "lm_head.weight" not in state:  # tied: the head is the embedding, one tensor
        state["lm_head.weight"] = state["embed.weight"]
    model.load_state_dict(state, strict=True, assign=True)
    model.init_rope(max_len or cfg.max_position_embeddings)
    model.eval().requires_grad_(False)
    log.info("loaded rank %d/%d of %s (%d layers, %.2f MB of weights, %s)", shard.rank, shard.world_size,
             model_dir, cfg.num_layers, resident_weight_bytes(model) / 2**20, dtype)
    return model


def _shard_state_dict(cfg: ModelConfig, ckpt: _Checkpoint, shard: Shard, has_head: bool) -> dict[str, torch.Tensor]:
    """Our names, this rank's slices (a tied head is left out: the caller ties it)."""
    q_span = _scaled(shard.span(cfg.num_heads), cfg.head_dim)  # rows of q_proj (and columns of o_proj)
    kv_span = _scaled(shard.span(cfg.num_kv_heads), cfg.head_dim)  # rows of k_proj and v_proj
    mlp_span = shard.span(cfg.intermediate_size)  # rows of gate/up, columns of down
    out = {"embed.weight": ckpt.full("embed_tokens.weight"), "norm.weight": ckpt.full("norm.weight")}
    if has_head and not cfg.tie_word_embeddings and ckpt.has("lm_head.weight"):
        out["lm_head.weight"] = ckpt.full("lm_head.weight")
    elif not has_head:
        out["lm_head.weight"] = torch.empty(0, cfg.hidden_size)
    for i in range(cfg.num_layers):
        src, dst = f"layers.{i}.", f"layers.{i}."
        attn, mlp = src + "self_attn.", src + "mlp."
        out[dst + "input_norm.weight"] = ckpt.full(src + "input_layernorm.weight")
        out[dst + "post_norm.weight"] = ckpt.full(src + "post_attention_layernorm.weight")
        spans = {"q": q_span, "k": kv_span, "v": kv_span}
        out[dst + "qkv.weight"] = torch.cat([ckpt.rows(attn + f"{p}_proj.weight", spans[p]) for p in "qkv"])
        if cfg.qkv_bias:
            out[dst + "qkv.bias"] = torch.cat([ckpt.rows(attn + f"{p}_proj.bias", spans[p]) for p in "qkv"])
        out[dst + "o_proj.weight"] = ckpt.columns(attn + "o_proj.weight", q_span)
        if cfg.o_bias:
            out[dst + "o_proj.bias"] = ckpt.full(attn + "o_proj.bias")  # added once, after the all-reduce
        out[dst + "gate_up.weight"] = torch.cat(
            [ckpt.rows(mlp + "gate_proj.weight", mlp_span), ckpt.rows(mlp + "up_proj.weight", mlp_span)]
        )
        out[dst + "down.weight"] = ckpt.columns(mlp + "down_proj.weight", mlp_span)
        if cfg.mlp_bias:
            out[dst + "gate_up.bias"] = torch.cat(
                [ckpt.rows(mlp + "gate_proj.bias", mlp_span), ckpt.rows(mlp + "up_proj.bias", mlp_span)]
            )
            out[dst + "down.bias"] = ckpt.full(mlp + "down_proj.bias")
    return out


def _scaled(span: tuple[int, int], head_dim: int) -> tuple[int, int]:
    return span[0] * head_dim, span[1] * head_dim
