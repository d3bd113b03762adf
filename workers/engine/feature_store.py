"""The target's features of registered blocks, kept for EAGLE sequences that claim those blocks later.

An EAGLE head's row t reads the target's feature of position t (its last hidden state there) and token t + 1. A
sequence that claims a registered block (prefix_cache.py) skips the target's pass over its positions, so it
never gets their features; where the block holds no head rows it could use, its head had nothing to compute
them from, and an EAGLE sequence claimed no further than the head rows went. Batches where speculation does not
pay never compute head rows (their plans draft nothing: Speculator.prefill), so their EAGLE sequences recomputed
every prompt plain decoding took from the cache: at 16 sequences cycling 8 prompts, EAGLE engines whose head
never drafted ran at 0.77-0.79x plain decoding's tokens/s, against 0.96-0.99x with prefix caching off in both.

So an engine with an EAGLE head and the cache keeps, per block id, the features of its positions:

    register (after a step):  a block the target computed in full, whose features its sequence still keeps
                              (SpecState: kept until the head reads them) -> copied here, the block marked
                              (prefix_cache.FEATURES, with the token that followed the block, as a head row's mark)
    claim (admission):        an EAGLE sequence claims past its head rows over blocks marked so; their features
                              come back from here into its SpecState, and its head takes them in as it would a
                              prefill chunk's (EagleProposer.prefill, or a proposal's catch-up)

A block's features are written once, when it is registered, and read while its key stands: a block allocated
anew loses its key and its mark with it (PrefixCache.forget). Memory: block_size x hidden values a block, in the
target's dtype (~6 % of a Llama-8B-like target's KV).
"""

import torch


class FeatureStore:
    def __init__(self, num_blocks: int, block_size: int, hidden_size: int, dtype: torch.dtype, device: torch.device) -> None:
        self.block_size = block_size
        self.rows = torch.zeros(num_blocks, block_size, hidden_size, dtype=dtype, device=device)  # [blocks, block, hidden]

    @staticmethod
    def bytes_per_block(block_size: int, hidden_size: int, dtype: torch.dtype) -> int:
        return block_size * hidden_size * dtype.itemsize

    def write(self, blocks: list[int], features: torch.Tensor) -> None:
        """features: [len(blocks) * block_size, hidden], the positions of `blocks` in order."""
        index = torch.tensor(blocks, dtype=torch.long, device=self.rows.device)  # [n]
        self.rows.index_copy_(0, index, features.view(len(blocks), self.block_size, -1).to(self.rows.dtype))

    def read(self, blocks: list[int]) -> torch.Tensor:
        """[len(blocks) * block_size, hidden]: a tensor of its own (never written again)."""
        index = torch.tensor(blocks, dtype=torch.long, device=self.rows.device)  # [n]
        return self.rows.index_select(0, index).view(len(blocks) * self.block_size, -1)
