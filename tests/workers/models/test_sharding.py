"""Shards read slice by slice (workers/models/shard_loader.py) are exactly the unsharded model's rows and columns;
sizes that do not divide the model are refused by name."""

import dataclasses
from pathlib import Path

import pytest
import torch

from workers.models.config import ModelConfig
from workers.models.loader import load_model
from workers.models.shard_loader import load_shard
from workers.models.sharded_llama import resident_weight_bytes
from workers.models.sharding import Shard, TensorParallelError, check_divisible, local_config


def _never(x: torch.Tensor) -> torch.Tensor:  # loading runs no forward, so no all-reduce
    raise AssertionError("no collective while loading")


@pytest.mark.parametrize("layout", ["llama", "qwen2"])
def test_two_shards_are_the_full_models_slices(tiny_models: dict[str, Path], layout: str) -> None:
    full = load_model(tiny_models[layout], torch.float32)
    cfg = full.cfg
    shards = [load_shard(tiny_models[layout], torch.float32, Shard(r, 2), _never) for r in range(2)]
    q, kv, inter = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    for i, layer in enumerate(full.layers):
        wq, wk, wv = layer.qkv.weight.split([q, kv, kv])  # [q | k | v] rows
        gate, up = layer.gate_up.weight.chunk(2)  # [I, hidden] each
        for r, shard in enumerate(shards):
            part = shard.layers[i]
            expected_qkv = torch.cat([w.chunk(2)[r] for w in (wq, wk, wv)])
            assert torch.equal(part.qkv.weight, expected_qkv)
            if cfg.qkv_bias:
                bq, bk, bv = layer.qkv.bias.split([q, kv, kv])
                assert torch.equal(part.qkv.bias, torch.cat([b.chunk(2)[r] for b in (bq, bk, bv)]))
            assert torch.equal(part.o_proj.weight, layer.o_proj.weight[:, r * q // 2 : (r + 1) * q // 2])
            assert torch.equal(part.gate_up.weight, torch.cat([gate.chunk(2)[r], up.chunk(2)[r]]))
            assert torch.equal(part.down.weight, layer.down.weight[:, r * inter // 2 : (r + 1) * inter // 2])
            assert torch.equal(part.input_norm.weight, layer.input_norm.weight)
    assert torch.equal(shards[0].lm_head.weight, full.lm_head.weight) and shards[1].lm_head.weight.numel() == 0
    assert all(torch.equal(s.embed.weight, full.embed.weight) for s in shards)
    assert resident_weight_bytes(shards[1]) < resident_weight_bytes(shards[0]) < resident_weight_bytes(full)


def test_local_config_and_refusals(tiny_models: dict[str, Path]) -> None:
    cfg = ModelConfig.from_dir(tiny_models["llama"])  # 4 heads, 2 KV heads, 128 MLP columns
    local = local_config(cfg, 2)
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size) == (2, 1, 64)
    assert local.head_dim == cfg.head_dim and local.hidden_size == cfg.hidden_size
    with pytest.raises(TensorParallelError, match="does not divide the model's 2 KV heads"):
        check_divisible(cfg, 4)
    odd = dataclasses.replace(cfg, intermediate_size=130)
    with pytest.raises(TensorParallelError, match=r"3 does not divide .*4 attention heads, 2 KV heads, 130 MLP"):
        check_divisible(odd, 3)
