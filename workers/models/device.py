"""Where a model and its KV cache live: the `device` engine setting, and the one crossing back to the host.

Every tensor the scheduler, the sampler and the speculation code touch stays on the CPU: a runner builds its
pass's inputs there, moves them to its device, and hands its logits back on the host (`to_host`), where the
seeded per-request generators draw. What stays on the device: what feeds the next pass there (an EAGLE head's
features), and the target's logits in a step that reads only their argmax (greedy chains, no grammar, no
logprobs: Engine.step), so S integers cross back instead of S x V floats.
"""

import re

import torch

DEVICE_PATTERN = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")


def resolve_device(name: str) -> torch.device:
    """`auto` = the first CUDA device where one is visible, else the CPU; `cpu`; `cuda` or `cuda:N`. Raises
    ValueError naming the problem for a malformed name or a CUDA device this process cannot see."""
    if not DEVICE_PATTERN.match(name):
        raise ValueError(f"device {name!r}: expected auto, cpu, cuda or cuda:N")
    if name == "auto":
        return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {name!r}: this torch build sees no CUDA device (torch {torch.__version__})")
        index = device.index or 0
        if index >= torch.cuda.device_count():
            raise ValueError(f"device {name!r}: only {torch.cuda.device_count()} CUDA devices are visible")
        return torch.device("cuda", index)
    return device


def to_host(t: torch.Tensor) -> torch.Tensor:
    """`t` on the CPU (itself when it is there already; a device tensor is copied, which waits for its pass)."""
    return t if t.device.type == "cpu" else t.cpu()
