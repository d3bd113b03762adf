"""Automatic prefix caching: full KV blocks of committed tokens, found again by their content.

A block's key is a digest of its tokens chained to the key of the block before it (BLAKE2b, 16 bytes), so it
names the tokens and their positions from the sequence's start: two sequences whose first n blocks hold the same
tokens have the same n keys, and the target's KV of those blocks is the same (it depends on nothing else). A
request's `cache_salt` (vLLM's) seeds its first key: requests share blocks only with requests of the same salt
(a tenant that wants no other tenant to tell, by a faster first token, that it sent the same prefix passes one
of its own). Once a block is full and the target has computed it, its sequence registers it under its key; a
sequence admitted later whose first blocks have registered keys takes those blocks instead of computing them
(BlockManager.claim).
A claimed block is shared, never written: a sequence computes from the first block it did not claim, and the
last prompt token is always computed (its logits sample the first token). A free block keeps its key until it
is allocated anew (least recently freed first), so a finished conversation's blocks serve its next turn.

The proposers' caches use the same block ids (block_manager.py): a registered block also records the methods
whose proposer rows it holds for its tokens (draft model, EAGLE head), and a sequence claims, for its proposer,
the leading blocks it could use. A draft model's row depends on the tokens up to its own, as the target's; an
EAGLE head's row t reads token t + 1 too, so its mark keeps the token that followed the block, and a sequence
whose next token is another does not count the block's head rows. Head rows need the target's features, which
only a target pass over those positions gives: an engine with an EAGLE head keeps the features of the blocks
it registers (feature_store.py; the mark FEATURES, with the token after the block as a head row's), and an EAGLE
sequence claims past its head rows as far as blocks hold them, its head computing those rows from the stored
features. Where a registered block's copy holds neither and an EAGLE sequence computes its own, the key moves to
its copy; a draft-model sequence has its draft take in the rest (workers/engine/speculator.py).
"""

import hashlib
from array import array
from collections.abc import Sequence as Tokens

KEY_BYTES = 16
FEATURES = "features"  # proposers_of's mark of a block whose target features the FeatureStore holds
SALT_PERSON = b"specfleet-salt"  # the salt's digest is of its own kind: never equal to a block's key by design


def block_keys(
    tokens: Tokens[int], block_size: int, known: list[bytes], num_tokens: int | None = None, salt: str | None = None
) -> list[bytes]:
    """The keys of every full block of the first `num_tokens` of `tokens` (all of them by default), extending
    `known` (the keys of its first blocks, computed before; returned grown in place). `salt` (vLLM's
    `cache_salt`) goes into the first block's key, so only requests with the same salt share blocks."""
    end = len(tokens) if num_tokens is None else num_tokens
    root = b"" if salt is None else hashlib.blake2b(salt.encode(), digest_size=KEY_BYTES, person=SALT_PERSON).digest()
    for start in range(len(known) * block_size, end - block_size + 1, block_size):
        digest = hashlib.blake2b(known[-1] if known else root, digest_size=KEY_BYTES)
        digest.update(array("q", tokens[start : start + block_size]).tobytes())
        known.append(digest.digest())
    return known


class PrefixCache:
    """Registered blocks by key, and what each one holds beyond the target's KV."""

    def __init__(self) -> None:
        self.block_of: dict[bytes, int] = {}  # key -> block id
        self.key_of: dict[int, bytes] = {}  # block id -> key
        # block id -> the methods whose proposer rows it holds (and FEATURES: the target's features, kept) -> the
        # token after the block when they were computed
        self.proposers_of: dict[int, dict[str, int]] = {}
        self.num_queried_tokens = 0  # prompt tokens looked up (admissions that could use the cache)
        self.num_hit_tokens = 0  # of those, tokens taken from registered blocks

    def match(self, keys: list[bytes]) -> list[int]:
        """The registered blocks of the longest prefix of `keys`."""
        blocks = []
        for key in keys:
            block = self.block_of.get(key)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def register(self, block: int, key: bytes) -> bool:
        """Register a computed block under its key; False where another block holds that key already (the same
        tokens computed twice: this copy stays unregistered) or the block has a key."""
        if key in self.block_of or block in self.key_of:
            return False
        self.block_of[key] = block
        self.key_of[block] = key
        self.proposers_of[block] = {}
        return True

    def forget(self, block: int) -> None:
        """The block is allocated anew: its content goes."""
        key = self.key_of.pop(block, None)
        if key is not None:
            del self.block_of[key]
            del self.proposers_of[block]
