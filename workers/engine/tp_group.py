"""The tensor-parallel group of one engine, seen from rank 0 (the engine's own process).

Rank 0 spawns ranks 1..N-1 (`python -m workers.engine.tp_rank`), each with a socket pair (the "pipe"). A step goes:

    rank 0: pipe -> each rank: the command and its sizes   (an idle rank waits here, with no timeout)
    rank 0: broadcast the command's tensors                 (tp_batch.py: ids, positions, tables, mask)
    every rank: its shard's forward, joining one all-reduce after each row-parallel projection

The pipe carries only small headers; tensors go through torch.distributed (gloo on CPU; nccl is the backend
for CUDA tensors, which this engine does not place models on yet). Nothing hangs on a dead rank: the process
group has a timeout, a dead peer's closed socket fails a collective at once, rank 0 checks its ranks are alive
before every command, and a rank whose pipe closes (rank 0 gone) exits. On any failure rank 0 stops every
other rank and raises RankFailedError; the group is unusable from then on.
"""

import dataclasses
import functools
import json
import logging
import os
import subprocess
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist

from workers.child_process import spawn_connected
from workers.engine.errors import EngineError
from workers.engine.model_runner import ForwardBatch
from workers.engine.tp_batch import pack
from workers.engine.tp_protocol import HOST, Collectives, Op, RankSpec, dtype_name, timeout
from workers.models.sharding import TensorParallelError

log = logging.getLogger(__name__)

START_TIMEOUT_S = 900.0  # the ranks have this long to load their shards
STOP_TIMEOUT_S = 10.0  # a rank asked to stop is terminated after this, then killed


class RankFailedError(EngineError):
    """A tensor-parallel rank died, or a collective failed: the engine cannot step any more."""


class TensorParallelGroup:
    """Rank 0's handle on ranks 1..N-1: spawn, connect, send each step's commands, stop."""

    def __init__(self, specs: list[RankSpec], store: dist.TCPStore) -> None:
        self.world_size = len(specs) + 1
        self.store = store
        self.collectives = Collectives()
        self.rank_weight_bytes: list[int] = [0] * self.world_size  # resident weight bytes of each rank
        self.error: RankFailedError | None = None  # set once the group failed
        self.procs: list[subprocess.Popen[bytes]] = []  # rank r at index r - 1
        self.conns: list[Connection] = []
        for spec in specs:
            proc, conn = spawn_connected(functools.partial(_rank_args, json.dumps(dataclasses.asdict(spec))))
            self.procs.append(proc)
            self.conns.append(conn)

    @classmethod
    def spawn(cls, target_dir: str, dtype: torch.dtype, world_size: int, max_len: int, num_threads: int,
              single_thread_max_tokens: int) -> "TensorParallelGroup":
        """Start ranks 1..world_size-1 loading their shards (rank 0 loads its own meanwhile, then connect())."""
        store = dist.TCPStore(HOST, 0, world_size, is_master=True, timeout=timeout(), wait_for_workers=False)
        base = RankSpec(0, world_size, target_dir, dtype_name(dtype), max_len, store.port, num_threads,
                        single_thread_max_tokens)
        return cls([dataclasses.replace(base, rank=r) for r in range(1, world_size)], store)

    @property
    def pids(self) -> list[int]:
        return [proc.pid for proc in self.procs]

    def connect(self, own_weight_bytes: int) -> None:
        """Wait until every rank loaded its shard, then form the process group (rank 0 = this process)."""
        self.rank_weight_bytes[0] = own_weight_bytes
        for rank, conn in enumerate(self.conns, start=1):
            message = self._receive(rank, conn)
            if message[0] != "ready":
                self._fail(f"tensor-parallel rank {rank} could not start: {message[1]}")
            self.rank_weight_bytes[rank] = int(message[1])
        try:
            self.collectives.connect(self.store, 0, self.world_size)
        except RuntimeError as exc:
            self._fail(f"tensor-parallel ranks did not connect: {exc}")
        log.info("tensor parallel: %d ranks (pids %s), weight bytes per rank %s", self.world_size, self.pids,
                 self.rank_weight_bytes)

    def _receive(self, rank: int, conn: Connection) -> tuple[Any, ...]:
        proc = self.procs[rank - 1]
        waited_s = 0.0
        while not conn.poll(1.0):
            waited_s += 1.0
            if proc.poll() is not None:
                self._fail(f"tensor-parallel rank {rank} exited while loading (exit code {proc.returncode})")
            if waited_s >= START_TIMEOUT_S:
                self._fail(f"tensor-parallel rank {rank} did not load its shard in {START_TIMEOUT_S:.0f} s")
        try:
            return tuple(conn.recv())
        except EOFError:
            self._fail(f"tensor-parallel rank {rank} exited while loading (exit code {proc.wait()})")
            raise  # unreachable: _fail raises

    # ---- rank 0's model calls these ------------------------------------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:  # [...] summed over the ranks, in place
        try:
            return self.collectives.all_reduce(x)
        except RuntimeError as exc:
            self._fail_in_collective("an all-reduce", exc)
            raise  # unreachable

    # ---- commands ---------------------------------------------------------------------------------------
    def allocate_kv(self, num_blocks: int, block_size: int) -> None:
        self._command((Op.KV_CACHE, num_blocks, block_size))

    def send_forward(self, batch: ForwardBatch) -> None:
        header, ints, mask = pack(batch)
        self._command((Op.FORWARD, *dataclasses.astuple(header)))
        self._broadcast(ints)
        self._broadcast(mask)

    def send_copy(self, src_slots: list[int], dst_slots: list[int]) -> None:
        self._command((Op.COPY_SLOTS, len(src_slots)))
        self._broadcast(torch.tensor([*src_slots, *dst_slots], dtype=torch.long))

    def _command(self, message: tuple[int, ...]) -> None:
        if self.error is not None:
            raise self.error
        for rank, (proc, conn) in enumerate(zip(self.procs, self.conns, strict=True), start=1):
            if proc.poll() is not None:
                self._fail(f"tensor-parallel rank {rank} died (exit code {proc.returncode})")
            try:
                conn.send(message)
            except OSError as exc:
                self._fail(f"tensor-parallel rank {rank} is gone: {exc}")

    def _broadcast(self, x: torch.Tensor) -> None:
        try:
            self.collectives.broadcast(x)
        except RuntimeError as exc:
            self._fail_in_collective("a broadcast", exc)

    def _fail_in_collective(self, what: str, exc: Exception) -> None:
        """Name the dead rank when one is (a killed peer fails the collective as its socket closes)."""
        dead = []
        for rank, proc in enumerate(self.procs, start=1):
            try:
                dead.append(f"tensor-parallel rank {rank} died (exit code {proc.wait(0.5)})")
            except subprocess.TimeoutExpired:
                continue
        self._fail(f"{'; '.join(dead)}: {what} failed" if dead else f"{what} failed: {exc}")

    def _fail(self, message: str) -> None:
        """Stop every rank and raise (this and every later call) RankFailedError."""
        log.error("tensor parallel group failed: %s", message)
        self.error = RankFailedError(message)
        self.close()
        raise self.error

    def close(self) -> None:
        """Ask every rank to stop, then terminate (and at last kill) any that did not. Idempotent."""
        for conn in self.conns:
            try:
                conn.send((Op.STOP,))
            except OSError:
                pass  # already gone
        for proc in self.procs:
            _stop(proc, STOP_TIMEOUT_S if self.error is None else 0.5)
        for conn in self.conns:
            conn.close()
        self.conns = []
        if self.error is None:
            self.error = RankFailedError("the tensor-parallel group was closed")


def _rank_args(spec_json: str, fd: int) -> list[str]:
    """The interpreter's arguments of a rank: its module, its end of the socket pair, its RankSpec."""
    return ["-m", "workers.engine.tp_rank", str(fd), spec_json]


def check_devices(world_size: int, device: torch.device) -> None:
    """On GPU, one rank per device: refuse more ranks than this machine has."""
    if device.type == "cuda" and world_size > torch.cuda.device_count():
        raise TensorParallelError(
            f"tensor_parallel_size {world_size} exceeds the {torch.cuda.device_count()} CUDA devices visible "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')})"
        )


def _stop(proc: subprocess.Popen[bytes], wait_s: float) -> None:
    """Wait `wait_s` for the rank to exit, then terminate it, then kill it."""
    for signal_it in (None, proc.terminate, proc.kill):
        if signal_it is not None:
            signal_it()
        try:
            proc.wait(wait_s if signal_it is None else STOP_TIMEOUT_S)
            return
        except subprocess.TimeoutExpired:
            continue
