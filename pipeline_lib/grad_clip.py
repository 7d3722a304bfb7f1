"""Clip the gradient norm of a whole pipelined model, as `torch.nn.utils.clip_grad_norm_`
clips an unpipelined one.

The norm that matters is the whole model's. A `Pipe` holds every stage in one process, so
its norm is PyTorch's over ``pipe.parameters()``. A `DistributedPipe` rank holds only its
own stages (two on a V schedule), and clipping each rank by its own part's norm would scale
the stages differently: a different update direction from the unpipelined model's. So each
rank sums its stages' ``|g|^p`` and the ranks of its pipeline all-reduce the sums
(torchtitan and Megatron do the same over their pipeline groups); for the inf-norm they
take the maximum, beside a flag for a NaN (a maximum over gloo drops NaN: one rank's
NaN gradient would pass as the others' finite norm). Replicas need no share in it: by
the time `DistributedPipe.step` returns, DDP has averaged the gradients over them, so
every replica finds the same norm. This relies on each parameter living on one rank:
`DistributedPipe` refuses weights tied across ranks, which would otherwise be counted
once per rank holding them.

On a ``tp × pp × dp`` mesh with tensor-parallel stages or sharded replicas (FSDP), a
rank holds parts of its weights' gradients (`DTensor`s: a slice per tp rank, a slice
per replica), and whole copies of others (a norm's weight, on every tp rank). Each rank
sums ``|g|^p`` over its parts, each divided by the number of ranks holding that same
part (its mesh's dimensions on which it is replicated), and one all-reduce over every
rank of the job adds them up: each value of the model counted once, whichever
dimensions split it.
"""
from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from pipeline_lib.distributed.pipe import DistributedPipe
from pipeline_lib.sharded import is_dtensor


def clip_grad_norm_(model: nn.Module | DistributedPipe | Tensor | Iterable[Tensor],
                    max_norm: float, norm_type: float | str = 2.0,
                    error_if_nonfinite: bool = False, foreach: bool | None = None) -> Tensor:
    """Scale the gradients of ``model`` (a `Pipe`, any module, this rank's share of a
    `DistributedPipe` on every rank of the job, or, as PyTorch's function takes them,
    parameters: one tensor or an iterable of them) so that the whole model's gradient
    norm is at most ``max_norm``; return that norm before clipping, as a float32 tensor.
    Call it after the step's backward (``pipe.step``) and before ``optimizer.step()``.
    ``error_if_nonfinite``: raise, leaving the gradients as they were, if the norm is inf
    or NaN (as PyTorch's does; with a `DistributedPipe`, on every rank of the pipeline,
    wherever the non-finite gradient is); otherwise they become NaN, as PyTorch's would.
    ``foreach``: as in PyTorch (None picks the faster kernels where they exist)."""
    max_norm = _number("max_norm", max_norm)
    if not max_norm > 0:
        raise ValueError(f"max_norm must be positive, got {max_norm}: the seeds' recipe uses 0.5")
    norm_type = _number("norm_type", norm_type)
    if not (norm_type == math.inf or norm_type >= 1):
        raise ValueError(f"norm_type must be at least 1 or math.inf, got {norm_type}")
    params = _parameters(model)
    grads = [p.grad for p in params if p.grad is not None]
    pipe = model if isinstance(model, DistributedPipe) else None
    device = pipe.mesh.device if pipe is not None else (
        grads[0].device if grads else torch.device("cpu"))
    split = pipe is not None and (pipe.mesh.tp > 1
                                  or (pipe.shard_parameters and pipe.mesh.dp > 1))
    if split:   # every rank of the job, each part counted once (see the docstring)
        local = _parts_norm(grads, norm_type, pipe.mesh.tp * pipe.mesh.dp, foreach, device)
        total = _over_the_pipeline(local, norm_type, None)
    else:
        local = (torch.nn.utils.get_total_norm(grads, norm_type, foreach=foreach)
                 .to(device, torch.float64)
                 if grads else torch.zeros((), dtype=torch.float64, device=device))
        total = local if pipe is None or pipe.mesh.pipe_group is None else \
            _over_the_pipeline(local, norm_type, pipe.mesh.pipe_group)
    total = total.float()
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"the total {norm_type}-norm of the gradients is {total.item()}, "
                           f"so they cannot be clipped (the gradients are left as they "
                           f"were): look for the step whose loss went inf or NaN, e.g. a "
                           f"learning rate too high or a log of 0")
    if split:   # as PyTorch's clip_grads_with_norm_, on each rank's parts
        coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        parts = [_local(g) for g in grads]
        if parts:
            torch._foreach_mul_(parts, coefficient.to(parts[0].device))
    else:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach=foreach)
    return total


def _local(t: Tensor) -> Tensor:
    return t.to_local() if is_dtensor(t) else t


def _copies(grad: Tensor, whole_copies: int) -> int:
    """How many ranks of the job hold the same values as this rank's part of ``grad``:
    a `DTensor`'s mesh dimensions on which it is replicated; a plain tensor is on every
    rank of its stage's tensor-parallel and data-parallel groups (``whole_copies``)."""
    if not is_dtensor(grad):
        return whole_copies
    from torch.distributed.tensor import Partial, Replicate   # loaded: grad is a DTensor
    if any(isinstance(p, Partial) for p in grad.placements):
        raise RuntimeError("a gradient is still a Partial DTensor (a sum not yet taken): "
                           "clip after DistributedPipe.step, which sums them")
    return math.prod(grad.device_mesh.size(dim) for dim, p in enumerate(grad.placements)
                     if isinstance(p, Replicate))


def _parts_norm(grads: list[Tensor], norm_type: float, whole_copies: int,
                foreach: bool | None, device: torch.device) -> Tensor:
    """This rank's share of the norm, for `_over_the_pipeline` over every rank: the
    largest ``|g|`` of its parts (inf-norm), or the sum of ``|g|^p`` of each part divided
    by its number of copies."""
    by_copies: dict[int, list[Tensor]] = {}
    for g in grads:
        by_copies.setdefault(_copies(g, whole_copies), []).append(_local(g))
    norms = {n: torch.nn.utils.get_total_norm(parts, norm_type, foreach=foreach)
             .to(device, torch.float64) for n, parts in by_copies.items()}
    if not norms:
        return torch.zeros((), dtype=torch.float64, device=device)
    if norm_type == math.inf:
        return torch.stack(list(norms.values())).max()
    powered = sum(norm ** norm_type / n for n, norm in norms.items())
    return powered ** (1.0 / norm_type)


def _over_the_pipeline(local: Tensor, norm_type: float, group: Any) -> Tensor:
    """The whole model's norm from each pipeline rank's ``local`` one: the p-norm from
    the sum of their p-th powers (a NaN or inf anywhere stays in the sum), the inf-norm
    from their maximum and a NaN flag (a gloo maximum skips NaN). One all-reduce, which
    every rank of the pipeline must join."""
    inf = norm_type == math.inf
    sent = torch.stack([local, local.isnan().double()]) if inf else local ** norm_type
    try:
        dist.all_reduce(sent, dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM, group=group)
    except RuntimeError as exc:   # a timeout, most likely: a rank that never came
        ranks = dist.get_process_group_ranks(group) if group is not None else \
            list(range(dist.get_world_size()))
        exc.add_note(f"raised while clip_grad_norm_ all-reduced the gradient norm over "
                     f"the pipeline's ranks {ranks}: every "
                     f"one of them must call clip_grad_norm_(pipe, ...) at the same point "
                     f"of each step (after pipe.step), or none")
        raise
    if inf:
        return torch.where(sent[1] > 0, math.nan, sent[0])
    return sent ** (1.0 / norm_type)


def _number(name: str, value: Any) -> float:
    """A float from a float, an int, a one-element tensor or a numeric string ("inf", as
    PyTorch takes it), else an error naming the argument; a bool is a flag, refused."""
    if isinstance(value, bool) or (isinstance(value, Tensor) and value.numel() != 1):
        raise TypeError(f"{name} must be a number, got {value!r}")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a number (e.g. 0.5, or math.inf for norm_type), "
                        f"got {value!r}") from None


def _parameters(model: Any) -> list[Tensor]:
    """What to clip: a module's (or `DistributedPipe`'s) parameters, or the parameters
    given as PyTorch's ``clip_grad_norm_`` takes them. A generator is read once, here."""
    if isinstance(model, (nn.Module, DistributedPipe)):
        return list(model.parameters())
    if isinstance(model, Tensor):
        return [model]
    if isinstance(model, Iterable) and not isinstance(model, (str, bytes, dict)):
        params = list(model)
        if all(isinstance(p, Tensor) for p in params):
            return params
    raise TypeError(f"clip_grad_norm_ takes a Pipe, a DistributedPipe, a module, or its "
                    f"parameters (a tensor or an iterable of tensors), got "
                    f"{type(model).__name__}")
