"""The classic API's batch rules: which inputs are split, and into how many micro-batches.

``pipe(*inputs)`` looks only at its top-level arguments. Each tensor is split along dim 0
by ``torch.chunk``, on its own; everything else (a number, None, a string, a list or
tuple even if it holds tensors) and every `NoChunk` tensor goes whole to each
micro-batch. ``torch.chunk`` makes pieces of ``ceil(rows / chunks)`` rows and the rest
last, so it may make fewer than ``chunks`` pieces: 10 rows in 4 → 3, 3, 3, 1; 6 rows in
4 → three pieces of 2; 20 rows in 8 → 3, 3, 3, 3, 3, 3, 2. Tensors of different lengths
are fine as long as they make as many pieces (3 rows and 6 rows in 5: three pieces each).

`pipeline_lib.microbatch` has the core `Pipe`'s rules instead (nested containers are
split, ``tensor_split`` sizes, every micro-batch gets a row).
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import Tensor

from pipeline_lib.microbatch import NoChunk, Presplit


def check(first_device: torch.device, inputs: Sequence[Any]) -> None:
    """At least one top-level tensor (there would be nothing to split), and every
    top-level tensor on the first stage's device (the classic Pipe moved nothing)."""
    if not any(isinstance(value, Tensor) for value in inputs):
        kinds = ", ".join(type(value).__name__ for value in inputs) or "nothing"
        raise TypeError(f"pipe(*inputs) needs at least one tensor among its arguments, got "
                        f"({kinds}); only top-level tensors are split into micro-batches "
                        f"(a list or tuple of tensors is passed whole), so pass the tensors "
                        f"as separate arguments: pipe(x, y)")
    for value in inputs:
        if isinstance(value, Tensor) and value.device != first_device:
            raise ValueError(f"every input tensor must be on the first stage's device "
                             f"{first_device}, got one on {value.device}; move it there "
                             f"(the classic Pipe required this too)")


def scatter(inputs: Sequence[Any], chunks: int) -> Presplit:
    """The micro-batches of ``inputs``: each a tensor (when ``inputs`` is one tensor) or
    a tuple of the first layer's positional arguments."""
    if len(inputs) == 1 and isinstance(inputs[0], Tensor):
        return Presplit(torch.chunk(inputs[0], chunks))
    columns: list[Sequence[Any] | None] = []
    count = None
    for value in inputs:
        if isinstance(value, Tensor):
            pieces = torch.chunk(value, chunks)
            if count is not None and len(pieces) != count:
                raise RuntimeError(
                    f"found different number of chunks produced for inputs: {count} and "
                    f"{len(pieces)}; torch.chunk splits {value.size(0)} rows into "
                    f"{len(pieces)} pieces of up to {pieces[0].size(0)}, so give the "
                    f"tensors lengths that make as many pieces, or wrap one in NoChunk")
            count = len(pieces)
            columns.append(pieces)
        else:
            columns.append(None)
    whole = [value.tensor if isinstance(value, NoChunk) else value for value in inputs]
    return Presplit(tuple(whole[j] if pieces is None else pieces[k]
                          for j, pieces in enumerate(columns)) for k in range(count))
