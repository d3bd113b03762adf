"""A tensor-parallel rank other than 0: a spawned process that loads its shard and serves rank 0's commands.

    load the shard -> tell rank 0 "ready" (or why not) -> join the process group
    loop: wait for a command on the pipe -> receive its tensors by broadcast -> run it on the shard

Its KV cache holds only its own KV heads; it never sees a request, a block manager or logits. It exits when
rank 0 says STOP, when the pipe closes (rank 0 is gone, killed or not), or when a collective fails (a peer died
or timed out): never waiting on a dead rank 0. SIGINT is ignored: a Ctrl-C in the terminal reaches every
process of the group, and rank 0 decides when its ranks stop (after its own graceful shutdown).
"""

import json
import logging
import signal
import sys
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist

from shared import gc_pauses
from workers.engine.model_runner import ForwardBatch, ModelRunner, ThreadPolicy
from workers.engine.tp_batch import BatchHeader, unpack
from workers.engine.tp_protocol import HOST, Collectives, Op, RankSpec, timeout
from workers.models.llama import eager_attend
from workers.models.shard_loader import load_shard
from workers.models.sharded_llama import ShardedLlamaModel, resident_weight_bytes
from workers.models.sharding import Shard

log = logging.getLogger(__name__)


def rank_main(spec: RankSpec, conn: Connection) -> None:
    """The spawned process's entry point; exits non-zero when it stops on an error."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s tp-rank-{spec.rank} %(levelname)s %(message)s")
    torch.set_num_threads(spec.num_threads)
    collectives = Collectives()
    try:
        model = load_shard(spec.target_dir, getattr(torch, spec.dtype), Shard(spec.rank, spec.world_size),
                           collectives.all_reduce, spec.max_len)
    except Exception as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        sys.exit(1)
    gc_pauses.settle()  # what loading left stays out of every later collection (shared/gc_pauses.py)
    conn.send(("ready", resident_weight_bytes(model)))
    try:
        store = dist.TCPStore(HOST, spec.store_port, spec.world_size, is_master=False, timeout=timeout())
        collectives.connect(store, spec.rank, spec.world_size)
        serve(conn, collectives, model, ThreadPolicy(spec.num_threads, spec.single_thread_max_tokens))
    except (RuntimeError, OSError) as exc:  # a peer died or timed out: rank 0 sees it too and stops
        log.error("stopping: %s", exc)
        sys.exit(1)


def serve(conn: Connection, collectives: Collectives, model: ShardedLlamaModel, threads: ThreadPolicy) -> None:
    runner: ModelRunner | None = None
    while True:
        try:
            command = conn.recv()
        except EOFError:  # rank 0 is gone
            log.error("rank 0 closed the pipe: stopping")
            sys.exit(1)
        op = Op(command[0])
        if op is Op.STOP:
            return
        if op is Op.KV_CACHE:
            runner = ModelRunner(model, num_blocks=command[1], block_size=command[2], threads=threads)
            continue
        assert runner is not None, "rank 0 allocates the KV cache before any step"
        if op is Op.FORWARD:
            header = BatchHeader(*command[1:])
            ints = torch.empty(header.num_ints, dtype=torch.long)  # [num_ints]
            mask = torch.empty(header.num_mask_bytes, dtype=torch.uint8)  # [B * Q * L]
            collectives.broadcast(ints)
            collectives.broadcast(mask)
            forward_shard(runner, unpack(header, ints, mask))
        elif op is Op.COPY_SLOTS:
            slots = torch.empty(2 * command[1], dtype=torch.long)  # [2 n]: sources, then destinations
            collectives.broadcast(slots)
            src, dst = slots.tolist()[: command[1]], slots.tolist()[command[1] :]
            runner.copy_slots(src, dst)


@torch.inference_mode()
def forward_shard(runner: ModelRunner, batch: ForwardBatch) -> None:
    """The shard's part of rank 0's forward: every layer (joining its all-reduces), no logits."""
    if runner.threads is not None:
        runner.threads.apply(int(batch.input_ids.shape[0]))
    attends = [eager_attend(batch.meta, k, v, runner.model.attn_scale) for k, v in runner.kv_caches]
    runner.model.hidden_states(batch.input_ids, batch.positions, attends)


if __name__ == "__main__":  # spawned by tp_group.py: python -m workers.engine.tp_rank FD SPEC_JSON
    rank_main(RankSpec(**json.loads(sys.argv[2])), Connection(int(sys.argv[1])))
