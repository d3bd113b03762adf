"""Each row's largest value and its first index: what greedy decoding and a greedy draft read of logits.

A RowMax answers as torch.max(rows, dim=-1) does, as lists: ties go to the first index, NaN counts as the
largest. The engine hands verification and its proposers the native one where the kernel library is loaded
(NativeAttention.row_max, workers/models/row_max.cpp), else torch_row_max.
"""

from collections.abc import Callable

import torch

RowMax = Callable[[torch.Tensor], tuple[list[float], list[int]]]  # [S, V] -> [S] maxima, [S] their indices


def torch_row_max(rows: torch.Tensor) -> tuple[list[float], list[int]]:  # [S, V] -> [S], [S]
    values, indices = rows.max(dim=-1)
    return values.tolist(), indices.tolist()
