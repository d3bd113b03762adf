"""Fixed-size KV blocks from a memory budget, and each sequence's block table.

A block id indexes the same rows of every KV cache the engine holds (target and, with speculation,
draft), so one table per sequence serves both and the budget counts both. Truncating a sequence (the
rollback of rejected speculative tokens) only moves its length back and returns whole trailing blocks.
"""

from collections import deque

from workers.engine.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free_block_ids: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_missing_blocks(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks `seq` still needs to hold `num_tokens` tokens of KV."""
        return max(0, self.blocks_for(num_tokens) - len(seq.block_table))

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self.free_block_ids)

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Grow `seq`'s block table to hold `num_tokens` tokens (call can_allocate first)."""
        missing = self.num_missing_blocks(seq, num_tokens)
        if missing > len(self.free_block_ids):
            raise RuntimeError(f"allocate: need {missing} blocks, {len(self.free_block_ids)} free")
        seq.block_table.extend(self.free_block_ids.popleft() for _ in range(missing))

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Keep KV room for the first `num_tokens` tokens only; whole blocks past that go back."""
        keep = self.blocks_for(num_tokens)
        while len(seq.block_table) > keep:
            self.free_block_ids.append(seq.block_table.pop())

    def free(self, seq: Sequence) -> None:
        self.free_block_ids.extend(reversed(seq.block_table))
        seq.block_table.clear()
