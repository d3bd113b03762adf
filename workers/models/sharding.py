"""Which part of each weight one tensor-parallel rank holds (Megatron-style sharding of a Llama-family model).

With N ranks, rank r holds attention heads [r H/N, (r+1) H/N) and KV heads [r KV/N, (r+1) KV/N) (grouped-query
attention keeps its groups: q head h reads KV head h // (H / KV), and both land on the same rank), and MLP
columns [r I/N, (r+1) I/N):

- column-parallel (rows of the weight, split by output): q, k, v and gate, up (their biases alike);
- row-parallel (columns of the weight, split by input): o and down; their outputs are partial sums that one
  all-reduce per layer adds up, and their biases are added once, after it;
- replicated: the embedding, the norms and (on rank 0, the only rank that computes logits) the LM head.

So each rank's model is an ordinary LlamaModel of `local_config` (H/N heads, KV/N KV heads, I/N MLP columns)
whose layers all-reduce (workers/models/sharded_llama.py), and its KV cache holds only its own heads.
"""

import dataclasses
from dataclasses import dataclass

from workers.models.config import ModelConfig


class TensorParallelError(ValueError):
    """A tensor-parallel size this model (or machine) cannot be split over."""


@dataclass(frozen=True)
class Shard:
    rank: int
    world_size: int

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} outside [0, {self.world_size})")

    def span(self, total: int) -> tuple[int, int]:
        """This rank's [start, stop) of `total` equal parts' units (heads, KV heads, MLP columns)."""
        size = total // self.world_size
        return self.rank * size, (self.rank + 1) * size


def check_divisible(cfg: ModelConfig, world_size: int) -> None:
    """Raise TensorParallelError naming each count `world_size` does not divide."""
    counts = {
        "attention heads": cfg.num_heads,
        "KV heads": cfg.num_kv_heads,
        "MLP columns (intermediate_size)": cfg.intermediate_size,
    }
    wrong = [f"{count} {what}" for what, count in counts.items() if count % world_size]
    if wrong:
        raise TensorParallelError(
            f"tensor_parallel_size {world_size} does not divide the model's " + ", ".join(wrong)
            + "; choose a size that divides every one of them"
        )


def local_config(cfg: ModelConfig, world_size: int) -> ModelConfig:
    """One rank's model: the same layers with 1/world_size of the heads, KV heads and MLP columns."""
    check_divisible(cfg, world_size)
    return dataclasses.replace(
        cfg,
        num_heads=cfg.num_heads // world_size,
        num_kv_heads=cfg.num_kv_heads // world_size,
        intermediate_size=cfg.intermediate_size // world_size,
    )
