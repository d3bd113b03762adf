"""What rank 0 and the other tensor-parallel ranks share: the commands, a rank's start-up spec, the collectives."""

import datetime
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

import torch
import torch.distributed as dist

COLLECTIVE_TIMEOUT_S = 120.0  # a collective (or the rendezvous) waiting longer than this fails
HOST = "127.0.0.1"


class Op(IntEnum):
    FORWARD = 1  # + BatchHeader fields; then broadcasts: ints, mask
    COPY_SLOTS = 2  # + number of moves; then a broadcast: [2 n] long (sources, then destinations)
    KV_CACHE = 3  # + num_blocks, block_size: allocate the rank's KV cache
    STOP = 4


@dataclass(frozen=True)
class RankSpec:
    """What a spawned rank needs to load its shard and join the group."""

    rank: int
    world_size: int
    target_dir: str
    dtype: str  # a torch dtype's name: "float32", "bfloat16", ...
    max_len: int
    store_port: int
    num_threads: int
    single_thread_max_tokens: int


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def timeout() -> datetime.timedelta:
    return datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)


class Collectives:
    """All-reduce and broadcast over the group's process group (set once every rank joined)."""

    def __init__(self) -> None:
        self.pg: Any = None  # a torch.distributed ProcessGroupGloo, once connected

    def connect(self, store: dist.Store, rank: int, world_size: int) -> None:
        self.pg = dist.ProcessGroupGloo(store, rank, world_size, timeout())

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:  # [...] summed over the ranks, in place
        self.pg.allreduce(x).wait()
        return x

    def broadcast(self, x: torch.Tensor) -> None:  # [...] rank 0's values, in place
        self.pg.broadcast(x, 0).wait()
