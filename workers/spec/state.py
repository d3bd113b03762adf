"""Per-sequence speculation state, and acceptance counters shared by sequences and the engine."""

from dataclasses import dataclass, field

import torch

from shared.speculation import SpeculativeMethod
from workers.spec.adaptive import SpecLengthController
from workers.spec.ngram import NgramIndex

MIN_FEATURE_ROWS = 64  # the smallest feature buffer a sequence holds (rows)
MAX_HELD_PASSES = 64  # pass outputs a sequence refers to for its features before it copies their rows over
MAX_HELD_PASS_ROWS = 128  # a larger pass output (a prefill chunk's) is copied from at once, not held


@dataclass
class AcceptanceCounts:
    num_steps: int = 0  # verification steps that carried draft tokens
    num_drafted: int = 0  # draft tokens (tree: nodes) proposed
    num_accepted: int = 0
    num_emitted: int = 0  # tokens those steps emitted: accepted + one recovered/bonus each
    num_rejected: int = 0  # steps whose target rejected a draft token (one at most: the first ends the path)
    drafted_per_position: list[int] = field(default_factory=list)  # [positions] draft depth i was verified
    accepted_per_position: list[int] = field(default_factory=list)  # [positions] draft depth i was accepted

    def record(self, num_drafted: int, num_accepted: int, depth: int, is_rejected: bool | None = None) -> None:
        """One verified step; `depth` = draft positions along the longest proposed path; `is_rejected`: the target
        rejected a draft token (a tree's accepted path ended at a node with children; None: num_accepted < depth,
        exact for a chain)."""
        self.num_steps += 1
        self.num_drafted += num_drafted
        self.num_accepted += num_accepted
        self.num_emitted += num_accepted + 1
        self.num_rejected += int(num_accepted < depth if is_rejected is None else is_rejected)
        missing = depth - len(self.drafted_per_position)
        if missing > 0:
            self.drafted_per_position.extend([0] * missing)
            self.accepted_per_position.extend([0] * missing)
        for i in range(depth):
            self.drafted_per_position[i] += 1
            self.accepted_per_position[i] += int(i < num_accepted)

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted / self.num_drafted if self.num_drafted else 0.0

    @property
    def rejection_rate(self) -> float:
        """Of the draft tokens the target judged, the share it rejected: 1 - alpha, the per-token acceptance of
        Leviathan et al. A path is judged up to its first rejection; the draft tokens after it were never tested,
        so they count in neither part (acceptance_rate counts them as not accepted, and so falls with k)."""
        num_judged = self.num_accepted + self.num_rejected
        return self.num_rejected / num_judged if num_judged else 0.0

    @property
    def mean_accepted_tokens(self) -> float:
        """tau: tokens emitted per target forward while speculating."""
        return self.num_emitted / self.num_steps if self.num_steps else 1.0

    def per_position_acceptance(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_position, self.drafted_per_position, strict=True)]


@dataclass
class SpecState:
    method: SpeculativeMethod  # DRAFT, NGRAM or EAGLE (a NONE request has no SpecState)
    controller: SpecLengthController
    ngram: NgramIndex | None  # prompt-lookup index over the committed tokens (ngram method)
    # tokens whose K/V are valid in the draft cache; EAGLE: head rows (row t reads feature t and token t + 1)
    draft_num_computed: int = 0
    counts: AcceptanceCounts = field(default_factory=AcceptanceCounts)
    fallback_reason: str | None = None  # set once the sequence decodes plainly for good
    # EAGLE: the target's features of committed positions the head has not consumed yet, kept from the target
    # passes that computed them: rows for positions features_start .. features_end - 1. The first of them live in
    # _feature_rows[_head:_tail], a buffer grown by doubling (a sequence that keeps features for many steps
    # without drafting appends in amortised constant time, not by a copy of all it holds every step); the rest
    # are still in the passes' own outputs (_pass_rows: (the pass's features, first row, rows), in order), copied
    # over when they are read, once MAX_HELD_PASSES are held, or at once from a pass of more than
    # MAX_HELD_PASS_ROWS rows. Most steps of a large batch draft nothing, and a sequence that ends before it
    # drafts again never copies them at all: copied at every step, keeping a row took ~11 us a sequence, 0.18 ms
    # of a 5 ms step of 16 demo sequences. Stepped in turn against copying at every step (2-core AVX-512 host,
    # 2026-12-06): 16 EAGLE sequences that draft nothing 1.015-1.028x tokens/s, chains of 2 every step
    # 1.007-1.035x at one sequence and 0.998-1.000x at 16 (read at every step there).
    features_start: int = 0
    _feature_rows: torch.Tensor | None = None  # [capacity, hidden]
    _head: int = 0
    _tail: int = 0
    _pass_rows: list[tuple[torch.Tensor, int, int]] = field(default_factory=list)  # ([T, hidden], first row, rows)
    _num_pass_rows: int = 0

    @property
    def is_active(self) -> bool:
        return self.fallback_reason is None

    @property
    def wants_features(self) -> bool:
        return self.method is SpeculativeMethod.EAGLE and self.is_active

    @property
    def features(self) -> torch.Tensor | None:  # [m, hidden] a view of the kept rows; None when there are none
        """Reading them copies the rows still held in pass outputs into the sequence's buffer."""
        if self._pass_rows:
            self._copy_pass_rows()
        if self._feature_rows is None or self._tail == self._head:
            return None
        return self._feature_rows[self._head : self._tail]

    @property
    def has_features(self) -> bool:
        return self._tail > self._head or self._num_pass_rows > 0

    @property
    def features_end(self) -> int:
        """One past the last position with a kept feature."""
        return self.features_start + self._tail - self._head + self._num_pass_rows

    def feature_rows(self, start: int, end: int) -> torch.Tensor | None:
        """[end - start, hidden] the kept features of positions start .. end - 1 (None unless all are kept), read
        where they are: nothing moves into the buffer. A view where they lie in one piece: copy it to keep it."""
        if not self.features_start <= start < end <= self.features_end:
            return None
        pieces: list[tuple[torch.Tensor, int, int]] = []  # (tensor, its row of the piece's first position, rows)
        if self._tail > self._head:
            assert self._feature_rows is not None
            pieces.append((self._feature_rows, self._head, self._tail - self._head))
        pieces += self._pass_rows
        parts = []
        position = self.features_start  # of the piece's first row
        for rows, first_row, n in pieces:
            lo, hi = max(start, position), min(end, position + n)
            if lo < hi:
                parts.append(rows[first_row + lo - position : first_row + hi - position])
            position += n
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def keep_features(self, start: int, features: torch.Tensor, first_row: int = 0, num_rows: int | None = None) -> None:
        """Keep features[first_row : first_row + num_rows] ([n, hidden]; num_rows None: to the end), the features
        of committed positions start .. start + n - 1; a gap (never expected) restarts the kept run. `features` must
        be the pass's own tensor, never written again (a runner's output): it is referred to, not copied, until
        the rows are read."""
        if num_rows is None:
            num_rows = features.shape[0] - first_row
        if num_rows <= 0:
            return
        if start != self.features_end:
            self._clear_features()
            self.features_start = start
        self._pass_rows.append((features, first_row, num_rows))
        self._num_pass_rows += num_rows
        if len(self._pass_rows) >= MAX_HELD_PASSES or features.shape[0] > MAX_HELD_PASS_ROWS:  # what it keeps alive
            self._copy_pass_rows()

    def _copy_pass_rows(self) -> None:
        """The rows held in pass outputs, into the buffer (grown by doubling when full)."""
        num_rows = self._num_pass_rows
        buffer = self._feature_rows
        if buffer is None or self._tail + num_rows > buffer.shape[0]:  # full: move the live rows to a larger one
            live = self._tail - self._head
            first = self._pass_rows[0][0]
            grown = first.new_empty(max(2 * (live + num_rows), MIN_FEATURE_ROWS), first.shape[1])  # [capacity, hidden]
            if buffer is not None:
                grown[:live] = buffer[self._head : self._tail]
            self._feature_rows, self._head, self._tail = grown, 0, live
        assert self._feature_rows is not None
        for features, first_row, n in self._pass_rows:
            self._feature_rows[self._tail : self._tail + n] = features[first_row : first_row + n]
            self._tail += n
        self._pass_rows.clear()
        self._num_pass_rows = 0

    def drop_features_before(self, position: int) -> None:
        """Forget features of positions before `position` (the head's cache holds their rows now)."""
        if position <= self.features_start:
            return
        num_dropped = position - self.features_start
        from_buffer = min(num_dropped, self._tail - self._head)
        self._head += from_buffer
        num_dropped -= from_buffer
        while num_dropped > 0 and self._pass_rows:  # rows not copied yet: dropped where they are
            features, first_row, n = self._pass_rows[0]
            if n <= num_dropped:
                self._pass_rows.pop(0)
                self._num_pass_rows -= n
                num_dropped -= n
            else:
                self._pass_rows[0] = (features, first_row + num_dropped, n - num_dropped)
                self._num_pass_rows -= num_dropped
                num_dropped = 0
        self.features_start = position
        if self._head == self._tail:
            self._head = self._tail = 0  # empty: the buffer is reused from its start

    def _clear_features(self) -> None:
        self._feature_rows, self._head, self._tail = None, 0, 0
        self._pass_rows = []
        self._num_pass_rows = 0

    def drop_kv(self) -> None:
        """The sequence lost its KV (preemption): the draft or head recomputes from the start."""
        self.draft_num_computed = 0
        self._clear_features()
        self.features_start = 0

    def fall_back(self, reason: str) -> None:
        self.fallback_reason = reason
        self.controller.is_fallen_back = True
        self.controller.k = 0
        self._clear_features()

    def metrics(self) -> dict[str, float]:
        return {
            "mean_accepted_tokens": self.counts.mean_accepted_tokens,
            "acceptance_rate": self.counts.acceptance_rate,
            "draft_rejection_rate": self.counts.rejection_rate,
            "num_spec_steps": float(self.counts.num_steps),
            "num_draft_tokens": float(self.counts.num_drafted),
            "num_accepted_tokens": float(self.counts.num_accepted),
            "num_rejected_tokens": float(self.counts.num_rejected),
            "spec_fallback": float(self.fallback_reason is not None),
        }


@dataclass
class MethodStats:
    """One speculation method's share of the engine-wide figures."""

    counts: AcceptanceCounts = field(default_factory=AcceptanceCounts)
    draft_time_s: float = 0.0  # time its proposer spent (n-gram lookups are not timed)


@dataclass
class SpecStats:
    """Engine-wide speculation figures since start (the worker exports them to Prometheus)."""

    counts: AcceptanceCounts = field(default_factory=AcceptanceCounts)
    accepted_length_histogram: dict[int, int] = field(default_factory=dict)  # accepted per seq-step -> count
    num_fallbacks: int = 0
    num_vetoed_steps: int = 0  # steps decoded plainly because speculation delivered less there (goodput_guard.py)
    num_unplanned_steps: int = 0  # steps decoded plainly because their batch's plans drafted nothing of late (replan.py)
    draft_time_s: float = 0.0
    verify_time_s: float = 0.0  # target forward + verification, in steps that carried draft tokens
    methods: dict[SpeculativeMethod, MethodStats] = field(default_factory=dict)  # method -> its own figures

    def by_method(self, method: SpeculativeMethod) -> MethodStats:
        return self.methods.setdefault(method, MethodStats())

    def record(
        self,
        num_drafted: int,
        num_accepted: int,
        depth: int,
        method: SpeculativeMethod | None = None,
        is_rejected: bool | None = None,
    ) -> None:
        self.counts.record(num_drafted, num_accepted, depth, is_rejected)
        self.accepted_length_histogram[num_accepted] = self.accepted_length_histogram.get(num_accepted, 0) + 1
        if method is not None:
            self.by_method(method).counts.record(num_drafted, num_accepted, depth, is_rejected)
