from workers.engine.block_manager import BlockManager
from workers.engine.detokenizer import Detokenizer
from workers.engine.sampling_params import SamplingParams
from workers.engine.sequence import Sequence


def make_seq(n: int) -> Sequence:
    return Sequence("s", list(range(n)), n, SamplingParams(), Detokenizer(lambda ids: "", [], []), None)


def test_allocate_grows_table_and_free_returns_blocks() -> None:
    manager = BlockManager(num_blocks=8, block_size=4)
    seq = make_seq(5)
    assert manager.num_missing_blocks(seq, 5) == 2
    manager.allocate(seq, 5)
    assert len(seq.block_table) == 2 and manager.num_free_blocks == 6
    manager.allocate(seq, 8)  # still fits in two blocks
    assert len(seq.block_table) == 2
    manager.allocate(seq, 9)
    assert len(seq.block_table) == 3 and manager.num_free_blocks == 5
    manager.free(seq)
    assert seq.block_table == [] and manager.num_free_blocks == 8


def test_truncate_returns_only_whole_trailing_blocks() -> None:
    manager = BlockManager(num_blocks=8, block_size=4)
    seq = make_seq(1)
    manager.allocate(seq, 16)
    first_two = seq.block_table[:2]
    manager.truncate(seq, 6)
    assert seq.block_table == first_two and manager.num_free_blocks == 6
    manager.truncate(seq, 6)  # idempotent
    assert manager.num_free_blocks == 6


def test_can_allocate_refuses_beyond_free_blocks() -> None:
    manager = BlockManager(num_blocks=2, block_size=4)
    assert manager.can_allocate(2) and not manager.can_allocate(3)


def computed(seq: Sequence) -> Sequence:
    seq.num_computed_tokens = len(seq)
    return seq


def test_a_computed_block_is_claimed_back_by_its_tokens_and_shared() -> None:
    manager = BlockManager(num_blocks=8, block_size=4, prefix_caching=True)
    first = make_seq(10)
    manager.allocate(first, 10)
    manager.register(computed(first))  # blocks 0 and 1 are full: registered; the third holds 2 tokens
    second = make_seq(13)  # the same first 10 tokens (0..9), then 3 more
    claimed = manager.claimable(second)
    assert claimed == first.block_table[:2] and manager.num_taken_from_free(claimed) == 0  # held by `first`
    manager.claim(second, claimed)
    assert second.num_computed_tokens == 8 and second.num_cached_tokens == 8
    assert [manager.refcounts[b] for b in claimed] == [2, 2]
    manager.free(first)
    assert [manager.refcounts[b] for b in claimed] == [1, 1] and manager.num_free_blocks == 6  # + first's 3rd block
    manager.free(second)
    assert manager.num_free_blocks == 8
    third = make_seq(9)  # 2 full blocks and one token: both blocks claimable, from the free list now
    assert manager.claimable(third) == claimed and manager.num_taken_from_free(claimed) == 2


def test_the_last_token_s_block_is_never_claimed_and_a_reallocated_block_is_forgotten() -> None:
    manager = BlockManager(num_blocks=3, block_size=4, prefix_caching=True)
    first = make_seq(8)
    manager.allocate(first, 8)
    manager.register(computed(first))
    manager.free(first)
    kept = manager.claimable(make_seq(9))
    assert len(kept) == 2 and manager.claimable(make_seq(8)) == kept[:1]  # a last token's block is computed
    filler = Sequence("f", [99] * 12, 12, SamplingParams(), Detokenizer(lambda ids: "", [], []), None)
    manager.allocate(filler, 12)  # every block allocated anew: their keys go
    manager.free(filler)
    assert manager.claimable(make_seq(9)) == []


def test_without_the_cache_nothing_is_claimed() -> None:
    manager = BlockManager(num_blocks=8, block_size=4)
    first = make_seq(10)
    manager.allocate(first, 10)
    manager.register(computed(first))
    assert manager.claimable(make_seq(13)) == []
