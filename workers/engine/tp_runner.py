"""The target over N tensor-parallel ranks, as the engine sees it: one ModelRunner on rank 0.

`load_target` returns the whole target (TP = 1: loader.py, today's path untouched) or rank 0's shard with its
group of spawned ranks (TP > 1). `ShardedModelRunner` is a ModelRunner whose every forward and KV move is first
sent to the other ranks (tp_group.py); rank 0 then runs its own shard, and its all-reduces join theirs. The
scheduler, block manager, draft, sampler and verifier stay on rank 0 and never know.
"""

import logging
from pathlib import Path

import torch

from workers.engine.config import EngineConfig
from workers.engine.model_runner import ForwardBatch, ModelRunner, ThreadPolicy
from workers.engine.tp_group import TensorParallelGroup, check_devices
from workers.models.compiled import CompiledModel
from workers.models.config import ModelConfig
from workers.models.llama import LlamaModel
from workers.models.loader import load_model
from workers.models.shard_loader import load_shard
from workers.models.sharded_llama import resident_weight_bytes
from workers.models.sharding import Shard, TensorParallelError, check_divisible

log = logging.getLogger(__name__)


def load_target(
    cfg: EngineConfig, target_dir: Path, dtype: torch.dtype, threads: ThreadPolicy, device: torch.device
) -> tuple[LlamaModel, TensorParallelGroup | None]:
    """(the model rank 0 runs, the group of the other ranks or None for TP = 1). Raises TensorParallelError
    before any process starts when the size does not divide the model, or asks for ranks on a CUDA device
    (the ranks run on CPUs over gloo: NCCL ranks are not built yet)."""
    size = cfg.tensor_parallel_size
    if size == 1:
        return load_model(target_dir, dtype, cfg.max_model_len or None, device), None
    if device.type != "cpu":
        raise TensorParallelError(
            f"tensor_parallel_size {size} on {device}: the ranks run on CPUs over gloo so far; "
            "set device: cpu, or tensor_parallel_size: 1"
        )
    model_cfg = ModelConfig.from_dir(target_dir)
    check_divisible(model_cfg, size)
    check_devices(size, torch.device("cpu"))  # the engine places its models on the CPU
    max_len = cfg.max_model_len or model_cfg.max_position_embeddings
    group = TensorParallelGroup.spawn(
        str(target_dir), dtype, size, max_len, threads.num_threads, threads.single_thread_max_tokens
    )
    try:
        model = load_shard(target_dir, dtype, Shard(0, size), group.all_reduce, max_len)
        group.connect(resident_weight_bytes(model))
    except BaseException:
        group.close()
        raise
    return model, group


def make_runner(
    model: LlamaModel, num_blocks: int, block_size: int, threads: ThreadPolicy, group: TensorParallelGroup | None
) -> ModelRunner:
    if group is None:
        return ModelRunner(model, num_blocks, block_size, threads)
    return ShardedModelRunner(model, num_blocks, block_size, threads, group)


class ShardedModelRunner(ModelRunner):
    """Rank 0's runner: its shard's KV cache and forward, each call mirrored on the other ranks. Eager only
    (EngineConfig refuses `compile` with tensor_parallel_size > 1)."""

    def __init__(
        self, model: LlamaModel, num_blocks: int, block_size: int, threads: ThreadPolicy, group: TensorParallelGroup
    ) -> None:
        super().__init__(model, num_blocks, block_size, threads)
        self.group = group
        group.allocate_kv(num_blocks, block_size)

    def _run(
        self, batch: ForwardBatch, compiled: CompiledModel | None, with_features: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:  # ([S, V] float32, [T, hidden] or None)
        self.group.send_forward(batch)
        return super()._run(batch, None, with_features)

    def copy_slots(self, src_slots: list[int], dst_slots: list[int]) -> None:
        self.group.send_copy(src_slots, dst_slots)
        super().copy_slots(src_slots, dst_slots)
