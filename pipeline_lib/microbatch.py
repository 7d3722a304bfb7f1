"""Splitting a mini-batch into micro-batches and gathering the results.

A batch is a tensor or a tree of values: tuples, lists and dicts, nested (`tree`). Every
tensor leaf with a batch dimension is split along dim 0, and they must agree on its size;
a tensor wrapped in `NoChunk`, and any other leaf (a 0-dim tensor, None, a flag, a
string), is handed unchanged to every micro-batch (a mask shared by all rows).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import Tensor

from pipeline_lib import tree
from pipeline_lib.deprecation import renamed_keywords


@dataclass(frozen=True)
class NoChunk:
    """Wrap a tensor to give it whole to every micro-batch instead of splitting it."""

    tensor: Tensor

    def __post_init__(self):
        if not isinstance(self.tensor, Tensor):
            raise TypeError(f"NoChunk wraps a tensor, got {type(self.tensor).__name__}")


class Presplit(tuple):
    """A batch already split into micro-batches, for a caller with its own splitting rules
    (`pipeline_lib.sync` splits as ``torch.chunk`` did): `split` hands its items on as
    they are, one micro-batch each. A tuple, so `tree` still sees every tensor in it."""


def _kinds(batch: Any) -> str:
    """What a batch holds, for errors: ``dict of (str, int)``."""
    names = sorted({type(leaf).__name__ for leaf in tree.leaves(batch)})
    return f"{type(batch).__name__} of ({', '.join(names)})"


def rows(batch: Any) -> int:
    """The batch size: dim 0 of the tensors that are split."""
    sizes = {t.size(0) for t in tree.tensors(batch) if t.dim() > 0}
    if not sizes:
        raise TypeError(f"the batch has no tensor to split along dim 0 (got {_kinds(batch)}); "
                        f"pass a tensor, or a tuple, list or dict holding at least one tensor "
                        f"with a batch dimension (torch.tensor(...) turns a list of numbers "
                        f"into one; wrap tensors shared by all rows in NoChunk)")
    if len(sizes) > 1:
        raise ValueError(f"tensors in the batch disagree on the batch size (dim 0): "
                         f"{sorted(sizes)}; wrap tensors that must not be split in NoChunk")
    return sizes.pop()


def check_rows(inputs: Any, target: Any) -> None:
    """A step pairs row k of the inputs with row k of the target, so both need as many."""
    have = rows(inputs)
    if not any(t.dim() > 0 for t in tree.tensors(target)):
        what = _kinds(target) if isinstance(target, (tuple, list, dict)) \
            else type(target).__name__
        raise TypeError(f"the target has no tensor to split along dim 0 (got {what}): a "
                        f"training step gives loss_fn(output, target) each micro-batch's "
                        f"rows of the target, so pass a target tensor with {have} rows "
                        f"(torch.tensor(...) turns a list of numbers into one); for a "
                        f"forward without a loss, call the pipe itself: pipe(inputs)")
    want = rows(target)
    if have != want:
        raise ValueError(f"the inputs have {have} rows (dim 0) but the target has {want}; "
                         f"row k of the target is the target of row k of the inputs, so give "
                         f"both the same batch size")


@renamed_keywords(chunks="microbatches")
def split(batch: Any, microbatches: int) -> list[Any]:
    """Split into ``microbatches`` micro-batches of as equal sizes as possible, each with
    the batch's structure.

    Uneven splits are allowed (10 rows in 4 micro-batches: 3, 3, 2, 2), but every
    micro-batch gets at least one row: a batch with fewer rows than ``microbatches`` is an
    error, since an empty micro-batch would give a mean loss of NaN.

    Each micro-batch's tensors are copies, not views of the batch's. Views of one tensor
    share its version counter, so a first layer working in place
    (``nn.ReLU(inplace=True)``) on micro-batch 1 would mark micro-batch 0's input, saved
    for its backward, as modified, and the backward fail. Views with counters of their
    own would hide real in-place changes of the caller's tensor from autograd; a copy of
    the input batch costs one pass over memory the size of the input (token ids, or an
    image batch: less than one layer's activations) and also leaves the caller's tensor
    as it was. The copies keep autograd's link to the batch (``torch.clone``).

    A `Presplit` batch is returned as its micro-batches, whatever ``microbatches`` says.
    """
    if isinstance(batch, Presplit):
        return list(batch)
    if (isinstance(microbatches, bool) or not isinstance(microbatches, int)
            or microbatches < 1):
        raise ValueError(f"microbatches must be an int >= 1, got {microbatches!r}")
    size = rows(batch)
    if size == 0:
        raise ValueError(f"the batch has 0 rows (dim 0 of its tensors is 0): there is "
                         f"nothing to split into {microbatches} micro-batches; pass at "
                         f"least {microbatches} rows (an empty last batch of a data loader: "
                         f"drop it, e.g. DataLoader(..., drop_last=True))")
    if size < microbatches:
        raise ValueError(f"a batch of {size} rows cannot be split into {microbatches} "
                         f"micro-batches; use at most {size} micro-batches or a larger batch")
    columns = []
    for leaf in tree.leaves(batch):
        if isinstance(leaf, NoChunk):
            columns.append([leaf.tensor] * microbatches)
        elif isinstance(leaf, Tensor) and leaf.dim() > 0:
            columns.append([part.clone() for part in torch.tensor_split(leaf, microbatches)])
        else:
            columns.append([leaf] * microbatches)
    return [tree.unflatten([column[k] for column in columns], batch)
            for k in range(microbatches)]


def gather(outputs: Sequence[Any]) -> Any:
    """Join micro-batch outputs into the batch's: each tensor leaf concatenated along
    dim 0, in the outputs' common structure.

    Only what has a well-defined join is accepted. A 0-dim tensor or a number is a value
    for a whole micro-batch (a mean, a sum, a count): whether the batch's value is their
    mean, their sum or something else cannot be told from the values, so it is refused.
    Other leaves (None, a flag, a string) must be the same in every micro-batch.
    """
    first = outputs[0]
    for k, out in enumerate(outputs):
        if not tree.same_structure(first, out):
            raise ValueError(f"the outputs of micro-batches 0 and {k} are structured "
                             f"differently ({_kinds(first)} vs {_kinds(out)}); a stage must "
                             f"return the same containers for every micro-batch")
    columns = zip(*(tree.leaves(out) for out in outputs))
    return tree.unflatten([_join(list(column)) for column in columns], first)


_PER_ROW = ("return one value per row instead (e.g. a loss with reduction='none') and "
            "reduce after pipe(x), or train with pipe.step(inputs, target, loss_fn), which "
            "weights each micro-batch's loss correctly")


def _join(values: list[Any]) -> Any:
    first = values[0]
    if isinstance(first, Tensor):
        others = [type(v).__name__ for v in values if not isinstance(v, Tensor)]
        if others:
            raise ValueError(f"the last stage returned a tensor for micro-batch 0 but a "
                             f"{others[0]} for another, in the same place")
        if any(v.dim() == 0 for v in values):
            raise ValueError(f"pipe(x) joins the micro-batches' outputs along dim 0, but the "
                             f"last stage returned a 0-dim tensor: one value for a whole "
                             f"micro-batch (a mean, a sum?), whose batch value cannot be "
                             f"told from the micro-batches' values; {_PER_ROW}")
        return torch.cat(values)
    if isinstance(first, (int, float, complex)) and not isinstance(first, bool):
        raise ValueError(f"the last stage returned a Python {type(first).__name__} "
                         f"({first!r} for micro-batch 0): pipe(x) cannot tell whether it is "
                         f"a count, a sum or a mean, so it cannot join the micro-batches' "
                         f"values; {_PER_ROW}")
    differs = [v for v in values if isinstance(v, Tensor) or v != first]
    if differs:
        odd = differs[0]
        raise ValueError(f"the last stage returned {first!r} for micro-batch 0 but {odd!r} "
                         f"for another; only tensors are joined across micro-batches, and "
                         f"other values must be the same in every one")
    return first


def loss_weights(microbatches: Sequence[Any]) -> list[float]:
    """The loss-scaling rule for a mean-reduced loss, in one place.

    A mean-reduced loss over the whole batch equals the sum over micro-batches of each
    micro-batch's mean loss times its share of the rows: L = Σ_i (b_i / B) · L_i. Every
    executor multiplies micro-batch i's loss by b_i / B before its backward, so the
    accumulated gradients equal those of the unsplit batch, even for uneven splits.
    (A loss averaging over tokens rather than rows returns a sum and a count: see `loss`.)
    """
    sizes = [rows(m) for m in microbatches]
    total = sum(sizes)
    return [r / total for r in sizes]
