"""Where each rank of a ``tp × pp × dp`` job sits: its coordinates on the mesh and the
groups it talks in, for a rank order written as Megatron-LM writes it.

An order lists the dimensions from the one whose coordinate changes fastest from one
global rank to the next, to the slowest: Megatron-LM's default ``"tp-cp-ep-dp-pp"``
(its ``RankGenerator``), i.e. ``"tp-dp-pp"`` without context and expert parallelism;
Llama 3's ``[TP, CP, PP, DP]`` (Dubey et al. 2024, Sec. 3.3.2) is ``"tp-pp-dp"``.
``torchrun`` fills a node with consecutive ranks, so the first dimension of the order
stays inside a node, and the next ones as far as the node's size allows: tensor
parallelism, which all-reduces every layer's activations, goes first in both. The
two differ in the data dimension: Megatron-LM keeps a stage's replicas nearer (their
gradient all-reduce is large), Llama 3 the pipeline's neighbours (with FSDP the data
dimension's traffic hides behind compute, and its groups are the ones that span the
most nodes).

`pipeline_lib.distributed.mesh` names its two 2-D orders differently: "replica-major"
(rank = replica · pp + pipe rank) is ``"pp-dp"``, "stage-major" is ``"dp-pp"``.

A `DeviceMesh` lays its ranks out row-major, its last dimension fastest: the mesh of an
order is ``init_device_mesh(device, sizes in reversed order, mesh_dim_names=reversed)``
(`device_mesh`).
"""
from __future__ import annotations

import math
from typing import Mapping

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

MEGATRON = "tp-dp-pp"
LLAMA3 = "tp-pp-dp"
DIMENSIONS = ("tp", "cp", "ep", "dp", "pp")   # the names `plan.Layout` uses


def parse(order: str, sizes: Mapping[str, int]) -> list[str]:
    """The dimensions of ``order``, fastest first, checked against ``sizes``."""
    dims = order.split("-")
    unknown = [d for d in dims if d not in DIMENSIONS]
    if unknown or len(set(dims)) != len(dims):
        raise ValueError(f"rank order {order!r}: each of {DIMENSIONS} at most once, joined "
                         f"by '-', fastest-changing first (Megatron-LM's default is "
                         f"{MEGATRON!r}, Llama 3's {LLAMA3!r})")
    if sorted(dims) != sorted(sizes):
        raise ValueError(f"rank order {order!r} names {sorted(dims)}, the sizes "
                         f"{dict(sizes)} name {sorted(sizes)}: name the same dimensions")
    bad = {d: n for d, n in sizes.items() if isinstance(n, bool) or not isinstance(n, int)
           or n < 1}
    if bad:
        raise ValueError(f"dimension sizes must be positive integers, got {bad}")
    return dims


def coordinates(rank: int, order: str, sizes: Mapping[str, int]) -> dict[str, int]:
    """Global ``rank``'s coordinate on each dimension."""
    coords = {}
    for dim in parse(order, sizes):
        rank, coords[dim] = divmod(rank, sizes[dim])
    return coords


def global_rank(coords: Mapping[str, int], order: str, sizes: Mapping[str, int]) -> int:
    """The rank at ``coords``: the inverse of `coordinates`."""
    rank, stride = 0, 1
    for dim in parse(order, sizes):
        rank += coords[dim] * stride
        stride *= sizes[dim]
    return rank


def groups(dim: str, order: str, sizes: Mapping[str, int]) -> list[list[int]]:
    """The groups of dimension ``dim``: ranks equal in every other coordinate, each
    group ordered by its ``dim`` coordinate, the groups by their first rank."""
    parse(order, sizes)
    world = math.prod(sizes.values())
    found: dict[tuple[int, ...], list[int]] = {}
    for rank in range(world):
        coords = coordinates(rank, order, sizes)
        key = tuple(coords[d] for d in sorted(sizes) if d != dim)
        found.setdefault(key, []).append(rank)
    return sorted(found.values())


def device_mesh(device_type: str, order: str, sizes: Mapping[str, int]) -> DeviceMesh:
    """The `DeviceMesh` of ``order``: ``mesh["tp"]`` and the others are its groups (every
    rank of the job must call it, with the same arguments)."""
    dims = parse(order, sizes)[::-1]
    return init_device_mesh(device_type, tuple(sizes[d] for d in dims), mesh_dim_names=tuple(dims))
