"""Prompt-lookup proposer: guess the next tokens by finding the current suffix earlier in the sequence.

For the sequence's tokens (prompt + output so far), the longest suffix n-gram (n from max_n down to min_n)
that also occurred earlier is located, and the tokens that followed its most recent earlier occurrence are
proposed. Those proposals carry no distribution: verify with draft_probs=None (q one-hot).

Incremental: per n, a dict maps each n-gram to the end positions of its occurrences (a stack, most recent
last). extend() and truncate() cost O(changed tokens * number of n), propose() O(max_n^2), never O(length).
The index lags one token behind the sequence: an n-gram is indexed only once a token follows it, so the
current suffix never finds itself and every match has a continuation.
"""

from collections.abc import Iterable


class NgramIndex:
    def __init__(self, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.min_n = min_n
        self.max_n = max_n
        self._tokens: list[int] = []
        # n -> n-gram -> end positions (exclusive) of its occurrences, ascending; all ends < len(tokens)
        self._ends: dict[int, dict[tuple[int, ...], list[int]]] = {n: {} for n in range(min_n, max_n + 1)}

    def __len__(self) -> int:
        return len(self._tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        """Append tokens (the prompt, then committed output as it is accepted)."""
        for token in tokens:
            self._index_ngrams_ending_at(len(self._tokens))  # they are followed by `token` now
            self._tokens.append(token)

    def truncate(self, length: int) -> None:
        """Roll back to the first `length` tokens (e.g. after rejected draft tokens were appended)."""
        if not 0 <= length <= len(self._tokens):
            raise ValueError(f"cannot truncate {len(self._tokens)} tokens to {length}")
        for end in range(len(self._tokens) - 1, max(length, 1) - 1, -1):  # ends indexed beyond the new lag
            for n, table in self._ends.items():
                if end >= n:
                    key = tuple(self._tokens[end - n : end])
                    stack = table[key]
                    stack.pop()  # the most recent occurrence is this one: ends were pushed in order
                    if not stack:
                        del table[key]
        del self._tokens[length:]

    def propose(self, k: int) -> list[int]:
        """Up to k tokens that followed the most recent earlier occurrence of the longest matching suffix."""
        num_tokens = len(self._tokens)
        if k <= 0:
            return []
        for n in range(min(self.max_n, num_tokens), self.min_n - 1, -1):
            ends = self._ends[n].get(tuple(self._tokens[num_tokens - n :]))
            if ends:
                start = ends[-1]  # < num_tokens, so at least one token follows
                return self._tokens[start : start + k]
        return []

    def _index_ngrams_ending_at(self, end: int) -> None:
        for n, table in self._ends.items():
            if end >= n:
                table.setdefault(tuple(self._tokens[end - n : end]), []).append(end)
