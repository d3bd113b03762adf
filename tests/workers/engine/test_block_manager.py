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
