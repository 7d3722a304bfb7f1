"""What a training step's ``loss_fn`` may return, and how a step turns the micro-batches'
losses into the batch's.

``loss_fn(output, target)`` runs on the last stage, once per micro-batch, and returns one
of two things (Megatron-LM accepts the same two):

* **a mean**, a scalar averaging over the micro-batch's rows (``F.cross_entropy`` with its
  default reduction). Micro-batch i's loss is weighted by b_i / B before its backward
  (`microbatch.loss_weights`): the gradients are those of the whole batch's mean. Exact
  when every row weighs the same.
* **a sum and a count**, ``SumCount(loss_sum, count)``: e.g. the cross-entropy summed over
  the micro-batch's tokens (``reduction="sum"``) and the number of tokens that are not
  padding (``(target != ignore_index).sum()``). The batch's loss is Σ loss_sum / Σ count,
  every token weighing the same however the padding falls into micro-batches, which the
  b_i / B rule gets wrong (and a micro-batch whose targets are all padding has a mean of
  0/0 = NaN, where the batch's is finite). Σ count is known only once the last
  micro-batch's forward has run, long after 1F1B's first backward; so each micro-batch
  backpropagates its sum unscaled, and when the step ends, the gradients *it* added are
  divided by the total count (`StepGradients`). Gradients already in ``.grad`` when the
  step began (several steps accumulated without ``zero_grad``) are set aside meanwhile
  and stay as they were.

The pair is a named type, not a plain tuple: ``(loss, accuracy)`` is as natural a thing
to return, and read as a sum and a count it would divide the loss by the accuracy.
"""
from __future__ import annotations

import math
import numbers
from typing import Any, Iterable, NamedTuple, NoReturn, Sequence

import torch
from torch import Tensor, nn

from pipeline_lib import tree
from pipeline_lib.devices import read_back
from pipeline_lib.sharded import is_dtensor


class SumCount(NamedTuple):
    """What ``loss_fn`` returns for a loss averaged over the whole batch's tokens (or any
    count that varies by micro-batch): the micro-batch's summed loss and how many
    elements it sums over. The step returns Σ sum / Σ count over all micro-batches."""

    sum: Tensor
    count: Tensor | int | float


class MicroLoss(NamedTuple):
    """What the last stage keeps of one micro-batch's loss, detached.

    Nothing here is read on the host while the step runs: on a GPU a read waits for the
    device's queue to empty, stalling the pipeline. The step checks them once, at its end
    (`check_losses`)."""

    value: Tensor                      # the weighted mean, or the unscaled loss sum
    count: Tensor | float | None       # SumCount's count (float64 on the loss's device,
    #                                    or a number); None for a mean
    empty: Tensor | None = None        # for a mean: NaN although the outputs are finite


def check_grad_mode(caller: str) -> None:
    """A training step runs backwards: autograd must be on where it is called."""
    if torch.is_inference_mode_enabled() or not torch.is_grad_enabled():
        raise RuntimeError(f"{caller} runs a backward, but it was called with autograd off "
                           f"(inside torch.no_grad() or torch.inference_mode()), so no "
                           f"gradient could be computed; call it outside that block (for a "
                           f"forward without gradients, call the pipe itself: pipe(x))")


def micro_loss(result: Any, microbatch: int, need_grad: bool, output: Any = None) -> MicroLoss:
    """``loss_fn``'s return value for ``microbatch`` as a `MicroLoss`. ``need_grad``: the
    loss was computed with autograd on, so it must carry a graph back to the model.
    ``output``: the stage output it was computed from, to tell a mean over no element
    (NaN from finite outputs) from a model that diverged. Checks what the host knows
    (types, shapes, a count given as a number); what only the device knows is computed
    there and checked at the step's end."""
    where = f"loss_fn returned {_kind(result)} for micro-batch {microbatch}"
    if isinstance(result, SumCount):
        loss, count = result
    elif isinstance(result, (tuple, list)):
        raise TypeError(f"{where}; return a mean-reduced scalar, or pipeline_lib.SumCount("
                        f"loss_sum, count) for a sum and the count it sums over. A plain "
                        f"pair is refused because it cannot be told from (loss, accuracy) "
                        f"or another auxiliary value, which would become a divisor; "
                        f"compute such values outside loss_fn (e.g. from pipe(x))")
    else:
        loss, count = result, None
    if not isinstance(loss, Tensor):
        raise TypeError(f"{where}; return a tensor computed from the model's output: a "
                        f"mean-reduced scalar, or SumCount(loss_sum, count). A Python "
                        f"number (from .item() or float()) carries no gradient")
    if not loss.is_floating_point():
        raise TypeError(f"{where}, a {loss.dtype} loss; return a real floating-point tensor "
                        f"(a complex or integer loss has no gradient to descend)")
    if loss.numel() != 1:
        raise ValueError(f"{where}, a loss of shape {list(loss.shape)}; return a scalar: "
                         f"its mean over the micro-batch, or SumCount(loss.sum(), count)")
    if need_grad and not loss.requires_grad:
        raise RuntimeError(f"{where}, a loss that does not require grad: its backward would "
                           f"compute no gradient. Was it detached (.detach(), "
                           f"torch.tensor(loss.item())) or computed under torch.no_grad()?")
    if count is None:
        return MicroLoss(loss.reshape(()), None, _empty_mean(loss, output))
    if isinstance(count, Tensor):
        if count.dtype == torch.bool:
            raise TypeError(f"{where}: SumCount's count is a bool tensor, a flag rather than "
                            f"a count (True would count as 1); count the elements it sums "
                            f"over, e.g. (target != PAD).sum()")
        if count.numel() != 1 or count.requires_grad:
            raise ValueError(f"{where}: its count must be one number that carries no "
                             f"gradient, got a tensor of shape {list(count.shape)}"
                             f"{' requiring grad' if count.requires_grad else ''}")
        return MicroLoss(loss.reshape(()), count.detach().reshape(()).to(torch.float64))
    if not isinstance(count, numbers.Real) or isinstance(count, bool):
        raise TypeError(f"{where}: SumCount's count must be a number or a one-element "
                        f"tensor, not {type(count).__name__}")
    _check_one_count(float(count), microbatch)
    return MicroLoss(loss.reshape(()), float(count))


def _check_one_count(count: float, microbatch: int) -> None:
    if not 0 <= count < math.inf:
        raise ValueError(f"loss_fn returned a SumCount for micro-batch {microbatch}: "
                         f"SumCount's count is {count}; a count is how many elements the "
                         f"sum adds up, a finite number >= 0")


def _empty_mean(loss: Tensor, output: Any) -> Tensor:
    """Whether a mean is NaN although the outputs it came from are finite, on the loss's
    device: a mean over no element (0 / 0), typically a micro-batch whose targets are all
    ignore_index. NaN outputs give a NaN loss unpipelined too: that is passed on. One sum
    over the outputs tells finite from not (an overflow to inf reads as not finite, and
    passes the NaN on)."""
    finite = torch.ones((), dtype=torch.bool, device=loss.device)
    for t in tree.tensors(output):
        if is_dtensor(t):   # logits split over a tensor-parallel group: its part
            t = t.to_local()
        if t.is_floating_point() or t.is_complex():
            total = t.detach().sum(dtype=None if t.is_complex() else torch.float32)
            finite = finite & torch.isfinite(total).to(loss.device)
    return torch.isnan(loss.detach()).reshape(()) & finite


def _kind(result: Any) -> str:
    if isinstance(result, Tensor):
        return f"a tensor of shape {list(result.shape)}"
    if isinstance(result, (tuple, list)):
        return f"a {type(result).__name__} of {len(result)}"
    return f"a {type(result).__name__}"


def _kinds_agree(losses: Sequence[MicroLoss]) -> bool:
    """True for sums and counts, False for means; refuses a mix."""
    counted = [loss.count is not None for loss in losses]
    if any(counted) and not all(counted):
        raise TypeError("loss_fn returned SumCount(loss_sum, count) for some micro-batches "
                        "and a single loss for others; return the same kind for all")
    return all(counted)


def check_losses(losses: Sequence[MicroLoss]) -> float | None:
    """What the host could not check while the micro-batches ran, with one read of the
    device (`devices.read_back`), at the step's end: no mean over no element, and every
    count finite and >= 0. Returns the total count (None for means)."""
    counted = _kinds_agree(losses)
    on_device = [(i, loss.count if counted else loss.empty) for i, loss in enumerate(losses)
                 if isinstance(loss.count if counted else loss.empty, Tensor)]
    read = read_back(torch.stack([v.to(torch.float64) for _, v in on_device])) \
        if on_device else []
    values = dict(zip((i for i, _ in on_device), read))
    if not counted:
        empty = [i for i, flag in values.items() if flag]
        if empty:
            _empty_mean_error(empty[0])
        return None
    for i, count in values.items():
        _check_one_count(count, i)
    return sum(values.values()) + sum(loss.count for loss in losses
                                      if not isinstance(loss.count, Tensor))


def _empty_mean_error(microbatch: int) -> NoReturn:
    raise ValueError(f"loss_fn returned a mean of nan for micro-batch {microbatch} although "
                     f"the model's outputs are finite: a mean over no element, as when "
                     f"every target of the micro-batch is ignore_index (padding). The "
                     f"batch's mean is finite if another micro-batch has a real target, "
                     f"but a mean per micro-batch cannot be; return "
                     f"pipeline_lib.SumCount(loss_sum, count), e.g. SumCount("
                     f"F.cross_entropy(out, y, ignore_index=PAD, reduction='sum'), "
                     f"(y != PAD).sum()), which divides by the whole batch's count")


def check_count(total: float) -> None:
    if not total > 0:
        raise ValueError(f"the counts loss_fn returned add up to {total} over the whole "
                         f"batch: there is nothing to average over (is every target "
                         f"padding, i.e. equal to ignore_index?)")


class StepGradients:
    """Keeps the gradients one step adds apart from those already in ``.grad``.

    Made when the step starts: it takes every parameter's ``.grad`` aside, so the step
    accumulates into empty ones. `commit` scales what the step added and adds back what
    was there; `discard`, for a step that failed, restores ``.grad`` as it was.
    """

    def __init__(self, parameters: Iterable[nn.Parameter]):
        self.parameters = list(parameters)
        self.before = [p.grad for p in self.parameters]
        for p in self.parameters:
            p.grad = None

    def commit(self, scale: float = 1.0) -> None:
        for p, before in zip(self.parameters, self.before):
            added = p.grad
            if added is not None and scale != 1.0:
                added.mul_(scale)
            if before is not None:
                p.grad = before if added is None else before.add_(added)

    def discard(self) -> None:
        for p, before in zip(self.parameters, self.before):
            p.grad = before
