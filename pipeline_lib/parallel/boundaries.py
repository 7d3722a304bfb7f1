"""A pipeline's messages between tensor-parallel stages: each tp rank sends ``1/t`` of
the activation, and the receiving tp group all-gathers it (Megatron-LM's scatter/gather,
Narayanan et al. 2021, Sec. 4.1).

Without sequence parallelism a tensor-parallel stage's output is the whole activation,
the same on each of its ``t`` ranks. Each rank sending all of it to its counterpart in
the next stage would move ``t`` copies across the link between the stages (between
nodes, in a large run). Instead each rank sends its ``1/t`` slice (of the last
dimension), and the next stage's ranks put the whole back together with an all-gather
inside their node; the gradient travels back the same way. With sequence parallelism
the activation is already split (each rank's positions), and is sent as it is.

`split_at_boundaries` puts the two halves on a stage as hooks: the output of a stage
whose next stage is on another pipe rank is sliced (`_Slice`: its gradient all-gathered),
the input of a stage whose previous stage is on another pipe rank is gathered
(`_Gather`: its gradient sliced). Both are exact, not approximations: the activation and
its gradient are the same on every rank of a tensor-parallel group, so a slice of each
rank's copy is a slice of all of them. A message between two stages of one rank is
handed over whole, in memory.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn


def _sliced(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    """This rank's ``1/t`` of ``x``'s last dimension."""
    return x.chunk(dist.get_world_size(group), -1)[dist.get_rank(group)].contiguous()


def _gathered(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    """Every rank's ``x`` joined along the last dimension, in rank order."""
    ranks = dist.get_world_size(group)
    parts = torch.empty((ranks * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.all_gather_single(parts, x.contiguous(), group=group)
    return torch.cat(parts.chunk(ranks), -1)


class _Slice(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group = group
        return _sliced(x, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return _gathered(grad, ctx.group), None


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group = group
        return _gathered(x, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return _sliced(grad, ctx.group), None


def _one_tensor(value: Any, where: str) -> Tensor:
    if not isinstance(value, Tensor) or not value.is_floating_point():
        raise TypeError(f"a tensor-parallel stage's {where} travels in slices of its last "
                        f"dimension: it must be one floating-point tensor, got "
                        f"{type(value).__name__}")
    return value


def split_at_boundaries(stage: nn.Module, group: dist.ProcessGroup, gather_input: bool,
                        slice_output: bool) -> None:
    """Make ``stage`` (tensor parallel over ``group``) take its input in slices
    (``gather_input``) and give its output in slices (``slice_output``); see the module
    docstring."""
    width = dist.get_world_size(group)
    if gather_input:
        stage.register_forward_pre_hook(
            lambda _, args: (_Gather.apply(_one_tensor(args[0], "input"), group),
                             *args[1:]))
    if slice_output:
        def slice_it(_: nn.Module, __: Any, out: Any) -> Tensor:
            out = _one_tensor(out, "output")
            if out.shape[-1] % width:
                raise ValueError(f"a tensor-parallel stage's output of shape "
                                 f"{list(out.shape)} cannot be sent in {width} equal "
                                 f"slices of its last dimension")
            return _Slice.apply(out, group)
        stage.register_forward_hook(slice_it)
