"""Prompt-lookup proposer: longest suffix match, most recent occurrence, k, rollback."""

import random

import pytest

from workers.spec.ngram import NgramIndex


def index_of(tokens: list[int], min_n: int = 1, max_n: int = 3) -> NgramIndex:
    index = NgramIndex(min_n, max_n)
    index.extend(tokens)
    return index


def brute_force_propose(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Reference: scan every earlier position for the longest suffix, latest first."""
    for n in range(min(max_n, len(tokens)), min_n - 1, -1):
        suffix = tokens[len(tokens) - n :]
        for end in range(len(tokens) - 1, n - 1, -1):
            if tokens[end - n : end] == suffix:
                return tokens[end : end + k][:k]
    return []


def test_proposes_the_continuation_of_the_longest_match() -> None:
    # suffix [7, 1, 2] occurred once (followed by 8); the shorter [1, 2] occurred later (followed by 9)
    assert index_of([7, 1, 2, 8, 8, 1, 2, 9, 9, 7, 1, 2]).propose(2) == [8, 8]


def test_uses_the_most_recent_occurrence() -> None:
    assert index_of([5, 1, 5, 2, 5, 3, 4, 5]).propose(1) == [3]


def test_respects_k() -> None:
    index = index_of([1, 2, 3, 4, 5, 6, 1, 2])
    assert index.propose(3) == [3, 4, 5]
    assert index.propose(10) == [3, 4, 5, 6, 1, 2]  # only what followed, at most up to the end
    assert index.propose(0) == []


def test_empty_when_no_match() -> None:
    assert index_of([1, 2, 3, 4]).propose(4) == []
    assert index_of([]).propose(4) == []
    assert index_of([1, 2, 3, 1], min_n=2).propose(4) == []  # only a 1-gram matches


def test_a_suffix_never_matches_itself() -> None:
    assert index_of([3, 3]).propose(4) == [3]  # the earlier 3 is followed by the last one


def test_truncate_rolls_back_the_index() -> None:
    index = index_of([1, 2, 3, 1, 2, 4])
    index.extend([1, 2])
    assert index.propose(1) == [4]
    index.truncate(5)  # back to [1, 2, 3, 1, 2]
    assert len(index) == 5
    assert index.propose(2) == [3, 1]
    index.truncate(0)
    assert index.propose(2) == []
    index.extend([6, 7, 6])
    assert index.propose(2) == [7, 6]


def test_matches_a_brute_force_reference_through_extends_and_truncates() -> None:
    rng = random.Random(0)
    index = NgramIndex(min_n=2, max_n=4)
    tokens: list[int] = []
    for _ in range(400):
        if tokens and rng.random() < 0.3:
            length = rng.randint(max(0, len(tokens) - 6), len(tokens))
            index.truncate(length)
            del tokens[length:]
        else:
            new = [rng.randint(0, 3) for _ in range(rng.randint(1, 4))]
            index.extend(new)
            tokens += new
        k = rng.randint(1, 5)
        assert index.propose(k) == brute_force_propose(tokens, 2, 4, k)


def test_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError):
        NgramIndex(0, 2)
    with pytest.raises(ValueError):
        NgramIndex(3, 2)
    with pytest.raises(ValueError):
        index_of([1, 2]).truncate(3)
