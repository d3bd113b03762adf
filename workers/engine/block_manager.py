"""Fixed-size KV blocks from a memory budget, and each sequence's block table.

A block id indexes the same rows of every KV cache the engine holds (target and, with speculation,
draft), so one table per sequence serves both and the budget counts both. Truncating a sequence (the
rollback of rejected speculative tokens) only moves its length back and returns whole trailing blocks.

With prefix caching (prefix_cache.py) a block may sit in several sequences' tables: each block counts the tables
that hold it and goes back to the free list when none does, keeping its key there until it is allocated anew
(the least recently freed first), so a later sequence with the same first tokens may claim it back. With an
EAGLE head the engine gives the manager a FeatureStore (feature_store.py): the target's features of the blocks
it registers, which EAGLE sequences that claim those blocks take back.
"""

from shared.speculation import SpeculativeMethod
from workers.engine.feature_store import FeatureStore
from workers.engine.prefix_cache import FEATURES, PrefixCache, block_keys
from workers.engine.sequence import Sequence

PROPOSER_METHODS = (SpeculativeMethod.DRAFT, SpeculativeMethod.EAGLE)  # the methods with KV rows of their own


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = False) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free_block_ids: dict[int, None] = dict.fromkeys(range(num_blocks))  # in the order they were freed
        self.refcounts = [0] * num_blocks  # the block tables holding each block
        self.cache = PrefixCache() if prefix_caching else None
        self.features: FeatureStore | None = None  # with the cache and an EAGLE head: set by the engine

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
        for _ in range(missing):
            block = next(iter(self.free_block_ids))
            del self.free_block_ids[block]
            if self.cache is not None:
                self.cache.forget(block)
            self.refcounts[block] = 1
            seq.block_table.append(block)

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Keep KV room for the first `num_tokens` tokens only; whole blocks past that go back."""
        keep = self.blocks_for(num_tokens)
        while len(seq.block_table) > keep:
            self._release(seq.block_table.pop())

    def free(self, seq: Sequence) -> None:
        for block in reversed(seq.block_table):
            self._release(block)
        seq.block_table.clear()
        seq.num_registered_blocks = seq.num_proposer_blocks = 0

    def _release(self, block: int) -> None:
        self.refcounts[block] -= 1
        if self.refcounts[block] == 0:
            self.free_block_ids[block] = None

    # ---- prefix caching ------------------------------------------------------------------------------
    def claimable(self, seq: Sequence) -> list[int]:
        """The registered blocks a sequence without KV could take for its first tokens (none with the cache off,
        for a sequence that holds KV, or one that asks for its prompt's logprobs: those need every row). Never
        the block of its last token, which computes the logits it samples from; for a preempted sequence (it has
        output), never so many that only its last token is left: that token runs as a decode, drafting as it
        would have (scheduler.py), so a seeded sample draws as it does without the cache."""
        if self.cache is None or seq.block_table or seq.num_computed_tokens or seq.params.prompt_logprobs is not None:
            return []
        keys = block_keys(seq.token_ids, self.block_size, seq.block_keys, salt=seq.params.cache_salt)
        most = (len(seq) - 1) // self.block_size
        if seq.num_output_tokens > 0 and len(seq) - most * self.block_size < 2:
            most -= 1
        blocks = self.cache.match(keys[:max(0, most)])
        method = _proposer_method(seq)
        if method is SpeculativeMethod.EAGLE:  # its head rows there, then the blocks whose features are kept
            blocks = blocks[: self._num_feature_blocks(seq, blocks, self._num_proposer_blocks(seq, blocks, method))]
        return blocks

    def num_taken_from_free(self, blocks: list[int]) -> int:
        """How many of `blocks` a claim takes off the free list (those no table holds now)."""
        return sum(1 for block in blocks if self.refcounts[block] == 0)

    def claim(self, seq: Sequence, blocks: list[int]) -> None:
        """Give a sequence without KV the registered `blocks` (claimable) for its first tokens: they count as
        computed, for the target and, as far as the blocks hold its proposer's rows, for its proposer."""
        assert self.cache is not None and not seq.block_table and seq.num_computed_tokens == 0
        for block in blocks:
            if self.refcounts[block] == 0:
                del self.free_block_ids[block]
            self.refcounts[block] += 1
        seq.block_table.extend(blocks)
        seq.num_computed_tokens = len(blocks) * self.block_size
        seq.num_registered_blocks = len(blocks)
        method = _proposer_method(seq)
        if method is not None and seq.spec is not None:
            seq.num_proposer_blocks = self._num_proposer_blocks(seq, blocks, method)
            seq.spec.draft_num_computed = seq.num_proposer_blocks * self.block_size
            if method is SpeculativeMethod.EAGLE and len(blocks) > seq.num_proposer_blocks:
                assert self.features is not None  # claimable() went past the head rows over blocks it holds
                seq.spec.keep_features(seq.spec.draft_num_computed, self.features.read(blocks[seq.num_proposer_blocks :]))
        if seq.num_preemptions == 0 and seq.num_cached_tokens == 0:
            seq.num_cached_tokens = seq.num_computed_tokens
        self.cache.num_queried_tokens += len(seq)
        self.cache.num_hit_tokens += seq.num_computed_tokens

    def count_miss(self, seq: Sequence) -> None:
        """An admission that looked the sequence up and claimed nothing (the hit rate's denominator)."""
        if self.cache is not None and seq.params.prompt_logprobs is None:
            self.cache.num_queried_tokens += len(seq)

    def register(self, seq: Sequence) -> None:
        """After a step: register the sequence's blocks the target has now computed in full (and mark those whose
        proposer rows its proposer has computed)."""
        if self.cache is None:
            return
        num_full = min(seq.num_computed_tokens, len(seq)) // self.block_size
        if num_full > seq.num_registered_blocks:
            keys = block_keys(seq.token_ids, self.block_size, seq.block_keys, num_full * self.block_size,
                              seq.params.cache_salt)
            first = seq.num_registered_blocks
            is_new = [self.cache.register(seq.block_table[i], keys[i]) for i in range(first, num_full)]
            seq.num_registered_blocks = num_full
            self._keep_features(seq, first, is_new)
        method = _proposer_method(seq)
        if method is None or seq.spec is None or seq.num_proposer_blocks >= seq.num_registered_blocks:
            return
        num_rows = min(seq.num_registered_blocks, seq.spec.draft_num_computed // self.block_size)
        is_head = method is SpeculativeMethod.EAGLE
        for index in range(seq.num_proposer_blocks, num_rows):
            after = (index + 1) * self.block_size  # a head row reads the token after it (prefix_cache.py)
            if is_head and after >= len(seq):
                num_rows = index
                break
            holds = self._proposer_marks(seq, index, method)
            if holds is not None:
                holds[method.value] = seq.token_ids[after] if is_head else -1
        seq.num_proposer_blocks = max(seq.num_proposer_blocks, num_rows)

    def _keep_features(self, seq: Sequence, first: int, is_new: list[bool]) -> None:
        """Blocks first, first + 1, ... of `seq`, just computed in full (is_new: registered under its key, not a
        copy of a block registered before): their features (an EAGLE sequence's, kept until its head reads them)
        into the FeatureStore, in one write over the run whose features it still keeps, and each new one marked
        with the token after it (a head row's mark: prefix_cache.py); the others are left unmarked."""
        spec = seq.spec
        if self.features is None or _proposer_method(seq) is not SpeculativeMethod.EAGLE or not any(is_new):
            return
        assert self.cache is not None and spec is not None
        size = self.block_size
        start = max(first, -(-spec.features_start // size))  # the first block whose features are all kept
        end = min(first + len(is_new), spec.features_end // size, (len(seq) - 1) // size)  # ... and a token after it
        if start >= end:
            return
        rows = spec.feature_rows(start * size, end * size)  # [(end - start) * size, hidden]
        assert rows is not None
        blocks = [seq.block_table[i] for i in range(start, end)]
        self.features.write(blocks, rows)
        for index in range(start, end):
            if is_new[index - first]:
                self.cache.proposers_of[seq.block_table[index]][FEATURES] = seq.token_ids[(index + 1) * size]

    def _num_feature_blocks(self, seq: Sequence, blocks: list[int], start: int) -> int:
        """How many leading `blocks` an EAGLE sequence may claim: the `start` whose head rows it takes, then those
        whose features the FeatureStore holds, the last one followed by seq's own next token (its head computes
        that block's last row, which reads that token, into the shared block)."""
        assert self.cache is not None
        num = start
        while num < len(blocks) and FEATURES in self.cache.proposers_of.get(blocks[num], {}):
            num += 1
        if num > start and self.cache.proposers_of[blocks[num - 1]][FEATURES] != seq.token_ids[num * self.block_size]:
            num -= 1
        return num

    def _proposer_marks(self, seq: Sequence, index: int, method: SpeculativeMethod) -> dict[str, int] | None:
        """The marks of `seq`'s block `index`; where the block is its own copy of one registered under the same key
        whose copy lacks this method's rows (an EAGLE sequence that found no head rows there computed its own),
        the key moves to its copy, which has them."""
        assert self.cache is not None
        block = seq.block_table[index]
        holds = self.cache.proposers_of.get(block)
        if holds is not None:
            return holds
        key = seq.block_keys[index]
        other = self.cache.block_of.get(key)
        if other is None or method.value in self.cache.proposers_of[other]:
            return None
        self.cache.forget(other)
        self.cache.register(block, key)
        return self.cache.proposers_of[block]

    def _num_proposer_blocks(self, seq: Sequence, blocks: list[int], method: SpeculativeMethod) -> int:
        """How many leading `blocks` hold the proposer rows `seq` would compute (an EAGLE head's: followed by
        seq's own next token)."""
        assert self.cache is not None
        num = len(blocks)
        for index, block in enumerate(blocks):
            if method.value not in self.cache.proposers_of.get(block, {}):
                num = index
                break
        if method is SpeculativeMethod.EAGLE and num:
            after = self.cache.proposers_of[blocks[num - 1]][method.value]
            if after != seq.token_ids[num * self.block_size]:
                num -= 1  # the blocks before it are followed by its own tokens: their keys say so
        return num


def _proposer_method(seq: Sequence) -> SpeculativeMethod | None:
    """The method whose proposer keeps KV rows for this sequence (the draft model, the EAGLE head), if any."""
    spec = seq.spec
    if spec is None or not spec.is_active or spec.method not in PROPOSER_METHODS:
        return None
    return spec.method
