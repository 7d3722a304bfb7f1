"""Tensor parallelism written out: Megatron-LM's f and g, the two linear layers they make,
and a Transformer block split over t ranks. A teaching module (notebook 08); runs use
`tensor_parallel`, PyTorch's plans, which compute the same.

A linear layer ``Y = X·Aᵀ`` splits two ways. **Column-parallel**: rank i holds rows A_i
of the weight (some outputs) and computes ``Y_i = X·A_iᵀ`` from the whole input; its
input gradient is a sum over the ranks, ``Σ_i dY_i·A_i``. **Row-parallel**: rank i holds
columns (some inputs) and computes the partial product ``X_i·A_iᵀ``; the output is their
sum. An MLP is a column-parallel layer then a row-parallel one, with the activation
between them on each rank's own columns: one sum in the forward (g, after the second
layer) and one in the backward (f, before the first). The attention is the same, with
heads for columns. So: two all-reduces per block forward, two backward.

f and g are each other's mirror: f is the identity forward and an all-reduce backward, g
an all-reduce forward and the identity backward. With sequence parallelism, each rank
keeps only T/t positions between the layers: g becomes a reduce-scatter (the sum, each
rank keeping its positions), f an all-gather; each one's backward is the other.
"""
from __future__ import annotations

import copy
from functools import partial
from typing import Callable

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn import functional as F

from pipeline_lib.parallel.block import ShardableBlock, check_splits

Group = dist.ProcessGroup


def _all_reduce(x: Tensor, group: Group) -> Tensor:
    x = x.clone()
    dist.all_reduce(x, group=group)
    return x


def _all_gather(x: Tensor, dim: int, group: Group) -> Tensor:
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim)


def _reduce_scatter(x: Tensor, dim: int, group: Group) -> Tensor:
    parts = [p.contiguous() for p in x.chunk(dist.get_world_size(group), dim)]
    out = torch.empty_like(parts[0])
    dist.reduce_scatter(out, parts, group=group)
    return out


class _Mirror(torch.autograd.Function):
    """``forward(x)`` one collective, its gradient the other."""

    @staticmethod
    def forward(ctx, x: Tensor, ahead: Callable, back: Callable) -> Tensor:  # type: ignore
        ctx.back = back
        return ahead(x)

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        return ctx.back(grad), None, None


def f(x: Tensor, group: Group) -> Tensor:
    """Identity forward, all-reduce backward: enters a column-parallel layer."""
    return _Mirror.apply(x, lambda t: t.view_as(t), partial(_all_reduce, group=group))


def g(x: Tensor, group: Group) -> Tensor:
    """All-reduce forward, identity backward: leaves a row-parallel layer."""
    return _Mirror.apply(x, partial(_all_reduce, group=group), lambda t: t)


def gather(x: Tensor, dim: int, group: Group) -> Tensor:
    """Sequence parallelism's f: all-gather the positions forward, reduce-scatter back."""
    return _Mirror.apply(x, partial(_all_gather, dim=dim, group=group),
                         partial(_reduce_scatter, dim=dim, group=group))


def scatter(x: Tensor, dim: int, group: Group) -> Tensor:
    """Sequence parallelism's g: reduce-scatter the positions forward, all-gather back."""
    return _Mirror.apply(x, partial(_reduce_scatter, dim=dim, group=group),
                         partial(_all_gather, dim=dim, group=group))


class ColumnParallelLinear(nn.Module):
    """This rank's rows of ``linear`` (its outputs): ``enter(x) @ A_iᵀ + b_i``."""

    def __init__(self, linear: nn.Linear, group: Group, enter: Callable[[Tensor], Tensor]):
        super().__init__()
        rank, ranks = dist.get_rank(group), dist.get_world_size(group)
        self.weight = nn.Parameter(linear.weight.detach().chunk(ranks, 0)[rank].clone())
        self.bias = nn.Parameter(linear.bias.detach().chunk(ranks, 0)[rank].clone())
        self.enter = enter

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(self.enter(x), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """This rank's columns of ``linear`` (its inputs): ``leave(x_i @ A_iᵀ) + b``, the
    bias added after the sum. On this rank's positions only (``positions``: sequence
    parallelism), the bias's gradient sums over the ranks, as a norm's weights' do."""

    def __init__(self, linear: nn.Linear, group: Group, leave: Callable[[Tensor], Tensor],
                 positions: bool = False):
        super().__init__()
        rank, ranks = dist.get_rank(group), dist.get_world_size(group)
        self.weight = nn.Parameter(linear.weight.detach().chunk(ranks, 1)[rank].clone())
        self.bias = nn.Parameter(linear.bias.detach().clone())
        self.leave, self.group, self.positions = leave, group, positions

    def forward(self, x: Tensor) -> Tensor:
        bias = f(self.bias, self.group) if self.positions else self.bias
        return self.leave(F.linear(x, self.weight)) + bias


class SequenceParallelNorm(nn.Module):
    """A LayerNorm on this rank's positions: its weights' gradient sums over the ranks."""

    def __init__(self, norm: nn.LayerNorm, group: Group):
        super().__init__()
        self.norm, self.group = norm, group

    def forward(self, x: Tensor) -> Tensor:
        n = self.norm
        return F.layer_norm(x, n.normalized_shape, f(n.weight, self.group),
                            f(n.bias, self.group), n.eps)


def split_block(block: ShardableBlock, group: Group,
                sequence_parallel: bool = False) -> ShardableBlock:
    """This rank's part of ``block`` (a copy): heads / t heads, d_hid / t hidden units.
    Its input and output are the whole activation, or under ``sequence_parallel`` this
    rank's T / t positions of it."""
    check_splits(block, dist.get_world_size(group))
    split = copy.deepcopy(block)
    layer, attention = split.layer, split.layer.self_attn
    if sequence_parallel:   # [B, T, d] everywhere but the out projection's [T·B, d]
        enter, leave = partial(gather, dim=1, group=group), partial(scatter, dim=1, group=group)
        leave_attention = partial(scatter, dim=0, group=group)
        layer.norm1, layer.norm2 = (SequenceParallelNorm(n, group)
                                    for n in (layer.norm1, layer.norm2))
    else:
        enter, leave = partial(f, group=group), partial(g, group=group)
        leave_attention = leave
    attention.register_forward_pre_hook(lambda _, args: (enter(args[0]),))   # f once
    for name in ("q_proj", "k_proj", "v_proj"):
        setattr(attention, name, ColumnParallelLinear(getattr(attention, name), group,
                                                      lambda x: x))
    attention.out_proj = RowParallelLinear(attention.out_proj, group, leave_attention,
                                           sequence_parallel)
    layer.linear1 = ColumnParallelLinear(layer.linear1, group, enter)
    layer.linear2 = RowParallelLinear(layer.linear2, group, leave, sequence_parallel)
    attention.tp_rank, attention.tp = dist.get_rank(group), dist.get_world_size(group)
    split.sequence_parallel = sequence_parallel
    return split
