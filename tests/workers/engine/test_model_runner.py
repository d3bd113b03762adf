"""The decode fast path of build_batch builds exactly the metadata the general (ragged) path builds, from
long_tensors' views of one int64 buffer."""

import pytest
import torch

from workers.engine.model_runner import (
    ForwardItem,
    _build_decode_batch,
    _build_ragged_batch,
    build_batch,
    long_tensors,
)

BLOCK_SIZE = 4


def _decode_items() -> list[ForwardItem]:
    return [
        ForwardItem([11], start_pos=0, block_table=[7], num_logits=1),
        ForwardItem([12], start_pos=9, block_table=[3, 1, 5, 2], num_logits=1),  # unused trailing block
        ForwardItem([13], start_pos=4, block_table=[0, 6], num_logits=0),  # no logits wanted
        ForwardItem([14], start_pos=7, block_table=[4, 8], num_logits=1, positions=[3]),  # a moved rotary position
    ]


@pytest.mark.parametrize("sliding_window", [None, 3])
def test_decode_fast_path_equals_ragged_path(sliding_window: int | None) -> None:
    fast = _build_decode_batch(_decode_items(), BLOCK_SIZE, sliding_window)
    general = _build_ragged_batch(_decode_items(), BLOCK_SIZE, sliding_window)

    for name in ("input_ids", "positions", "logits_indices"):
        assert torch.equal(getattr(fast, name), getattr(general, name)), name
    for name in ("slot_mapping", "block_tables", "mask", "token_seq", "key_start", "key_end"):
        assert torch.equal(getattr(fast.meta, name), getattr(general.meta, name)), name
    assert fast.meta.query_index is None and general.meta.query_index is None
    assert fast.meta.flat_index is None and general.meta.flat_index is None
    assert fast.input_ids.tolist() == [11, 12, 13, 14]
    assert fast.meta.slot_mapping.tolist() == [7 * 4 + 0, 5 * 4 + 1, 6 * 4 + 0, 8 * 4 + 3]
    assert fast.logits_indices.tolist() == [0, 1, 3]
    assert fast.meta.key_end.tolist() == [1, 10, 5, 8]  # keys each token sees: its own position and before
    expected_start = [0, 0, 0, 0] if sliding_window is None else [0, 7, 2, 5]
    assert fast.meta.key_start.tolist() == expected_start


def test_build_batch_takes_the_ragged_path_for_multi_token_items() -> None:
    items = [*_decode_items(), ForwardItem([1, 2, 3], start_pos=0, block_table=[9], num_logits=1)]

    batch = build_batch(items, BLOCK_SIZE)

    assert batch.meta.max_query_len == 3
    assert batch.meta.flat_index is not None  # padded queries exist, so the ragged layout was built


@pytest.mark.parametrize(
    "columns",
    [
        [[3], [-1, 0, 2**62], [], [7, 8]],  # negatives, int64's range, an empty column
        [[], []],  # nothing at all: frombuffer refuses an empty buffer, so an empty tensor stands in
        [list(range(600)), [5] * 40],  # a prefill's columns
    ],
)
def test_long_tensors_are_the_columns_as_int64(columns: list[list[int]]) -> None:
    tensors = long_tensors(columns)

    assert len(tensors) == len(columns)
    for tensor, column in zip(tensors, columns, strict=True):
        assert tensor.dtype == torch.long and tensor.shape == (len(column),)
        assert tensor.tolist() == column
    if len(tensors[0]):  # views of one buffer: writing one never touches the others
        tensors[0].fill_(99)
        assert [t.tolist() for t in tensors[1:]] == columns[1:]


def test_long_tensors_refuse_what_int64_cannot_hold() -> None:
    with pytest.raises(OverflowError):
        long_tensors([[2**63]])
