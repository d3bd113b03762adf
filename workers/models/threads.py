"""A block with a fixed torch thread count: training and measuring runs whose results depend on it."""

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def pinned_threads(num_threads: int) -> Iterator[None]:
    """Run the block with exactly `num_threads` torch threads (results depend on it), then restore."""
    previous = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
