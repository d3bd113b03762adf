"""The `device` setting (workers/models/device.py) on a machine of any kind: names, refusals, the CPU."""

from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from tests.workers.engine_runs import make_engine
from workers.engine.config import EngineConfig
from workers.engine.model_runner import ThreadPolicy
from workers.engine.tp_runner import load_target
from workers.models.device import resolve_device, to_host
from workers.models.sharding import TensorParallelError


def test_cpu_and_auto_resolve() -> None:
    assert resolve_device("cpu") == torch.device("cpu")
    expected = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    assert resolve_device("auto") == expected


@pytest.mark.parametrize("name", ["gpu", "cuda:", "cuda:x", "CPU", ""])
def test_a_malformed_device_is_refused_by_name(name: str) -> None:
    with pytest.raises(ValueError, match="expected auto, cpu, cuda or cuda:N"):
        resolve_device(name)
    with pytest.raises(ValidationError, match="device"):
        EngineConfig(device=name)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where no CUDA device is visible")
def test_a_cuda_device_this_process_cannot_see_is_refused(tiny_target: Path) -> None:
    with pytest.raises(ValueError, match="sees no CUDA device"):
        resolve_device("cuda:1")
    with pytest.raises(ValueError, match="sees no CUDA device"):
        make_engine(tiny_target, device="cuda")


def test_tensor_parallel_ranks_on_a_cuda_device_are_refused_before_any_starts(tiny_target: Path) -> None:
    cfg = EngineConfig(target_dir=str(tiny_target), tensor_parallel_size=2)
    with pytest.raises(TensorParallelError, match="ranks run on CPUs over gloo"):
        load_target(cfg, tiny_target, torch.float32, ThreadPolicy(1, 4), torch.device("cuda", 0))


def test_a_cpu_engine_keeps_everything_on_the_host(tiny_target: Path) -> None:
    engine = make_engine(tiny_target, device="cpu")
    assert engine.device == torch.device("cpu") and engine.graph_capture_s == {}
    assert engine.runner.graphs is None  # graphs are captured on CUDA devices only
    assert all(k.device.type == "cpu" for k, _ in engine.runner.kv_caches)
    # one cache block past the block manager's: the decode graphs' scratch block
    assert engine.runner.kv_caches[0][0].shape[0] == engine.block_manager.num_blocks + 1
    logits = torch.zeros(2, 3)
    assert to_host(logits) is logits
