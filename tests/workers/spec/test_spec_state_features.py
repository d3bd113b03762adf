"""An EAGLE sequence's kept features (SpecState): appended in order, dropped from the front as the head
consumes them, restarted on a gap, and held in a buffer that grows by doubling rather than by a copy a step."""

import torch

from shared.speculation import SpeculativeMethod
from workers.spec.adaptive import AdaptiveConfig, SpecLengthController
from workers.spec.state import SpecState


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


def test_many_single_rows_grow_the_buffer_by_doubling() -> None:
    """A sequence that never drafts keeps every feature: log2 buffers, not one copy a step."""
    spec = state()
    buffers = set()
    for position in range(1000):
        spec.keep_features(position, rows(position, 1))
        buffers.add(spec._feature_rows.data_ptr())
    assert len(buffers) <= 5  # 64, 128, 256, 512, 1024 rows
    assert torch.equal(spec.features, rows(0, 1000))


def test_consumed_rows_make_room_without_a_copy_a_step() -> None:
    """The head consuming features every few steps: a new buffer only every ~live-rows appends."""
    spec = state()
    buffers = 0
    last = None
    for position in range(1000):
        spec.keep_features(position, rows(position, 1))
        if spec._feature_rows.data_ptr() != last:
            buffers, last = buffers + 1, spec._feature_rows.data_ptr()
        if position % 7 == 0:
            spec.drop_features_before(position - 50)
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
