"""Splitting a mini-batch into micro-batches and gathering the results.

A batch is a tensor or a tuple of values. Tensors are split along dim 0 (the batch
dimension); anything else, and tensors wrapped in `NoChunk`, is handed unchanged to every
micro-batch (a mask shared by all rows, a flag).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import Tensor


@dataclass(frozen=True)
class NoChunk:
    """Wrap a tensor to give it whole to every micro-batch instead of splitting it."""

    tensor: Tensor

    def __post_init__(self):
        if not isinstance(self.tensor, Tensor):
            raise TypeError(f"NoChunk wraps a tensor, got {type(self.tensor).__name__}")


def _rows(batch: Any) -> int:
    values = batch if isinstance(batch, tuple) else (batch,)
    sizes = {v.size(0) for v in values if isinstance(v, Tensor) and v.dim() > 0}
    if not sizes:
        raise TypeError("the batch has no tensor to split along dim 0; pass at least one "
                        "tensor with a batch dimension (wrap shared ones in NoChunk)")
    if len(sizes) > 1:
        raise ValueError(f"tensors in the batch disagree on the batch size (dim 0): "
                         f"{sorted(sizes)}; wrap tensors that must not be split in NoChunk")
    return sizes.pop()


def split(batch: Any, chunks: int) -> list[Any]:
    """Split into ``chunks`` micro-batches of as equal sizes as possible.

    Uneven splits are allowed (10 rows in 4 chunks: 3, 3, 2, 2), but every micro-batch
    gets at least one row: a batch with fewer rows than ``chunks`` is an error, since an
    empty micro-batch would give a mean loss of NaN.
    """
    if chunks < 1:
        raise ValueError(f"chunks must be >= 1, got {chunks}")
    rows = _rows(batch)
    if rows < chunks:
        raise ValueError(f"a batch of {rows} rows cannot be split into {chunks} "
                         f"micro-batches; use chunks <= {rows} or a larger batch")
    values = batch if isinstance(batch, tuple) else (batch,)
    parts = []
    for v in values:
        if isinstance(v, NoChunk):
            parts.append([v.tensor] * chunks)
        elif isinstance(v, Tensor) and v.dim() > 0:
            parts.append(list(torch.tensor_split(v, chunks)))
        else:
            parts.append([v] * chunks)
    micro = list(zip(*parts))
    return [m if isinstance(batch, tuple) else m[0] for m in micro]


def gather(outputs: Sequence[Any]) -> Any:
    """Concatenate micro-batch outputs along dim 0 (tensor-wise for tuples)."""
    first = outputs[0]
    if isinstance(first, tuple):
        return tuple(gather([o[k] for o in outputs]) for k in range(len(first)))
    if isinstance(first, Tensor) and first.dim() > 0:
        return torch.cat(list(outputs))
    return first


def loss_weights(microbatches: Sequence[Any]) -> list[float]:
    """The loss-scaling rule, in one place.

    A mean-reduced loss over the whole batch equals the sum over micro-batches of each
    micro-batch's mean loss times its share of the rows: L = Σ_i (b_i / B) · L_i. Every
    executor multiplies micro-batch i's loss by b_i / B before its backward, so the
    accumulated gradients equal those of the unsplit batch, even for uneven splits.
    """
    rows = [_rows(m) for m in microbatches]
    total = sum(rows)
    return [r / total for r in rows]
