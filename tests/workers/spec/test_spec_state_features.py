"""An EAGLE sequence's kept features (SpecState): appended in order, dropped from the front as the head
consumes them, restarted on a gap, referred to in the passes' outputs until read, and held in a buffer that grows
by doubling rather than by a copy a step."""

import torch

from shared.speculation import SpeculativeMethod
from workers.spec.adaptive import AdaptiveConfig, SpecLengthController
from workers.spec.state import MAX_HELD_PASS_ROWS, MAX_HELD_PASSES, SpecState


def state() -> SpecState:
    return SpecState(method=SpeculativeMethod.EAGLE, controller=SpecLengthController(AdaptiveConfig()), ngram=None)


def rows(start: int, n: int) -> torch.Tensor:  # [n, 2]: row p holds (p, -p)
    positions = torch.arange(start, start + n, dtype=torch.float32)
    return torch.stack([positions, -positions], dim=1)


def test_features_append_and_drop_like_one_tensor() -> None:
    spec = state()
    assert spec.features is None and spec.features_end == 0
    spec.keep_features(10, rows(10, 5))
    spec.keep_features(15, rows(15, 1))
    assert spec.features_start == 10 and spec.features_end == 16
    assert torch.equal(spec.features, rows(10, 6))
    spec.drop_features_before(13)
    assert spec.features_start == 13 and torch.equal(spec.features, rows(13, 3))
    spec.drop_features_before(12)  # already gone: nothing changes
    assert torch.equal(spec.features, rows(13, 3))
    spec.drop_features_before(16)  # all consumed
    assert spec.features is None and spec.features_start == spec.features_end == 16
    spec.keep_features(16, rows(16, 2))
    assert torch.equal(spec.features, rows(16, 2))


def test_a_gap_restarts_the_kept_run() -> None:
    spec = state()
    spec.keep_features(0, rows(0, 4))
    spec.keep_features(9, rows(9, 2))  # positions 4..8 never came: only what follows the gap is kept
    assert spec.features_start == 9 and torch.equal(spec.features, rows(9, 2))


def test_rows_stay_in_the_pass_outputs_until_they_are_read() -> None:
    """Most steps of a large batch draft nothing: keeping a row refers to the pass's output, no copy; reading the
    features copies them over once, and a drop takes rows not copied yet off where they are."""
    spec = state()
    passes = [rows(0, 4), rows(4, 1), torch.cat([rows(100, 2), rows(5, 3)])]  # the last one's rows 2..4 are ours
    spec.keep_features(0, passes[0])
    spec.keep_features(4, passes[1])
    spec.keep_features(5, passes[2], first_row=2, num_rows=3)
    assert spec._feature_rows is None and spec.has_features
    assert spec.features_start == 0 and spec.features_end == 8
    spec.drop_features_before(3)  # the head consumed rows 0..2: gone from the first pass output, nothing copied
    assert spec._feature_rows is None and spec.features_end == 8
    spec.drop_features_before(6)
    assert spec._feature_rows is None and spec.features_start == 6
    assert torch.equal(spec.features, rows(6, 2))  # read: copied into the sequence's own buffer
    assert spec._feature_rows is not None and not spec._pass_rows
    passes[2].zero_()  # the pass outputs are no longer referred to
    assert torch.equal(spec.features, rows(6, 2))


def test_a_range_of_rows_reads_across_the_buffer_and_the_pass_outputs_and_moves_nothing() -> None:
    """feature_rows (what a block's registration copies into the FeatureStore): any range of kept positions, in one
    piece or across the buffer and several pass outputs; None for a range not all kept; the state unchanged."""
    spec = state()
    spec.keep_features(0, rows(0, 4))
    assert spec.features is not None  # read: positions 0..3 now in the buffer
    spec.keep_features(4, rows(4, 3))
    spec.keep_features(7, torch.cat([rows(100, 1), rows(7, 2)]), first_row=1)
    spec.drop_features_before(1)
    held = list(spec._pass_rows)
    for start, end in ((1, 9), (2, 4), (3, 8), (4, 7), (5, 6), (7, 9)):
        assert torch.equal(spec.feature_rows(start, end), rows(start, end - start)), (start, end)
    assert spec.feature_rows(0, 4) is None and spec.feature_rows(5, 10) is None and spec.feature_rows(3, 3) is None
    assert spec._pass_rows == held and spec.features_start == 1 and spec.features_end == 9


def test_a_sequence_that_never_drafts_holds_a_bounded_number_of_pass_outputs() -> None:
    """Every MAX_HELD_PASSES kept rows are copied into a buffer that grows by doubling: log2 buffers, not one copy
    a step, and never more than MAX_HELD_PASSES pass outputs held alive."""
    spec = state()
    buffers = set()
    for position in range(1000):
        spec.keep_features(position, rows(position, 1))
        assert len(spec._pass_rows) < MAX_HELD_PASSES
        if spec._feature_rows is not None:
            buffers.add(spec._feature_rows.data_ptr())
    assert len(buffers) <= 5  # 128, 384, ... rows
    assert torch.equal(spec.features, rows(0, 1000))


def test_rows_of_a_large_pass_are_copied_at_once() -> None:
    """A prefill chunk's pass output is not held alive for a few of its rows."""
    spec = state()
    spec.keep_features(0, rows(0, 2))
    big = rows(2, MAX_HELD_PASS_ROWS + 1)
    spec.keep_features(2, big, first_row=0, num_rows=3)
    assert not spec._pass_rows and spec._feature_rows is not None and spec.features_end == 5
    big.zero_()
    assert torch.equal(spec.features, rows(0, 5))


def test_consumed_rows_make_room_without_a_copy_a_step() -> None:
    """The head consuming features every few steps: a new buffer only every ~live-rows appends."""
    spec = state()
    buffers = 0
    last = None
    for position in range(1000):
        spec.keep_features(position, rows(position, 1))
        if position % 7 == 0:
            spec.drop_features_before(position - 50)
            assert torch.equal(spec.features, rows(spec.features_start, position + 1 - spec.features_start))
        if spec._feature_rows is not None and spec._feature_rows.data_ptr() != last:
            buffers, last = buffers + 1, spec._feature_rows.data_ptr()
    assert buffers <= 1000 // 40  # each move copies the ~50 live rows: constant work per appended row
    assert torch.equal(spec.features, rows(spec.features_start, 1000 - spec.features_start))


def test_preemption_and_fallback_forget_the_features() -> None:
    spec = state()
    spec.keep_features(0, rows(0, 3))
    spec.drop_kv()
    assert spec.features is None and spec.features_start == 0
    spec.keep_features(0, rows(0, 3))
    spec.fall_back("head_error")
    assert spec.features is None and not spec.wants_features
