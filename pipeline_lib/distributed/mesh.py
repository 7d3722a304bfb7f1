"""The processes of a multi-process pipeline, laid out on a ``tp × pp × dp`` mesh, and the
process groups they talk through. Every rank calls `init_mesh` (inside
`job.process_group`, which joins the torchrun job) with the same arguments.

``dp`` replicas of a ``pp``-rank pipeline, each stage of which is split over ``tp``
tensor-parallel ranks (``tp = 1``: the 2-D grid of notebook 05). The names are
`pipeline_lib.plan.Layout`'s. Two rank orders for the 2-D grid (``order=``):

    "replica-major" (the default): global rank replica * pp + pipe_rank
    pp = 4, dp = 2     pipe rank:  0   1   2   3
                       replica 0:  0   1   2   3      <- one pipeline
                       replica 1:  4   5   6   7      <- another, fed other rows

    "stage-major": global rank pipe_rank * dp + replica
                       replica 0:  0   2   4   6
                       replica 1:  1   3   5   7      <- a stage's DDP group: neighbours

torchrun fills a node with consecutive ranks, so the order decides which traffic stays
inside a node. Replica-major keeps each pipeline's point-to-point messages (every
micro-batch, both ways) inside a node and sends the gradient all-reduce between nodes;
stage-major keeps each DDP group inside a node (DeepSpeed's `PipeDataParallelTopology`
and Megatron-LM's default), which is what a job needs when its all-reduce moves more
bytes than its pipeline boundaries, as it usually does (notebook 05 counts them). The
ranks holding the same stages (a column above) form a data-parallel group. The ranks of
one pipeline (a row) form a pipeline group, for the few collectives a pipeline needs as a
whole (the global gradient norm, `pipeline_lib.grad_clip`). Each ordered pair of pipe
ranks that exchange messages gets a *channel*, a 2-rank group carrying that direction
only (`p2p` says why), made by `Mesh.connect` for the pairs a pipe's lowered programs use
(`lowering.LoweredSchedule.pairs`): neighbours, the ring's closing pair for looped
schedules, and any two ranks a skip connection joins.

With ``tp > 1`` the tensor-parallel ranks are the fastest dimension (consecutive ranks,
one node's NVLink): in `parallel.rank_order`'s notation, fastest first, "replica-major"
is ``"tp-pp-dp"`` (Llama 3's order) and "stage-major" ``"tp-dp-pp"`` (Megatron-LM's
default); ``order=`` also takes such a string itself. ``pp = 2, dp = 2, tp = 2``::

    "tp-dp-pp" (Megatron-LM)       rank:  0  1  2  3  4  5  6  7
                                   tp:    0  1  0  1  0  1  0  1
                                   dp:    0  0  1  1  0  0  1  1
                                   pp:    0  0  0  0  1  1  1  1
    "tp-pp-dp" (Llama 3)           pp and dp swapped: rank 2 is pipe rank 1 of replica 0

A pipeline is then ``tp`` parallel *lines*, one per tensor-parallel rank: each message
of a stage goes from a tp rank to the same tp rank of the next stage (the ranks that
hold the same coordinates but the pipe rank), over a channel of that line. The
tensor-parallel group (same pipe rank and replica) runs the collectives of tensor
parallelism; the data-parallel group (same pipe rank and tp rank) DDP's or FSDP's. The
groups are also a `DeviceMesh` (``mesh.device_mesh["tp"]``, ``["dp"]``) for PyTorch's
tensor-parallel plans and ``fully_shard``.
"""
from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from pipeline_lib.distributed.launch import rank_device
from pipeline_lib.parallel import rank_order


def check_same_everywhere(what: str, config: dict[str, Any]) -> None:
    """Raise on every rank if the ranks were given different ``config``: ranks that
    disagree about the job would wait for messages that never come."""
    configs: list[dict[str, Any] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(configs, config)
    differ = [r for r, c in enumerate(configs) if c != configs[0]]
    if differ:
        raise ValueError(f"the ranks were given different {what}: rank 0 has {configs[0]}; "
                         + "; ".join(f"rank {r} has {configs[r]}" for r in differ)
                         + ": every rank must run the same program with the same arguments")


RANK_ORDERS = ("replica-major", "stage-major")
# the 2-D grid's orders in `rank_order`'s notation, tensor parallelism fastest
_AS_DIMENSIONS = {"replica-major": "tp-pp-dp", "stage-major": "tp-dp-pp"}
# seconds a channel's own timeout adds to the mesh's: `p2p` names a wait that passes the
# mesh's timeout first, before NCCL's watchdog ends the process without a word on it
CHANNEL_GRACE = 30.0


def dimensions(order: str) -> str:
    """``order`` in `parallel.rank_order`'s notation (fastest dimension first): the 2-D
    grid's "replica-major" and "stage-major", or such a string of ``tp``, ``pp`` and
    ``dp`` (without ``tp``, it is the fastest)."""
    if order in _AS_DIMENSIONS:
        return _AS_DIMENSIONS[order]
    named = order if "tp" in order.split("-") else f"tp-{order}"
    try:
        rank_order.parse(named, {"tp": 1, "pp": 1, "dp": 1})
    except ValueError:
        raise ValueError(f"unknown rank order {order!r}: choose one of {RANK_ORDERS}, or "
                         f"name tp, pp and dp fastest first, e.g. {rank_order.MEGATRON!r} "
                         f"(Megatron-LM's) or {rank_order.LLAMA3!r} (Llama 3's)") from None
    return named


def grid_rank(order: str, pp: int, dp: int, replica: int, pipe_rank: int) -> int:
    """The global rank of ``(replica, pipe_rank)`` in a ``dp × pp`` grid numbered in
    ``order`` (see the module docstring)."""
    return rank_order.global_rank({"tp": 0, "pp": pipe_rank, "dp": replica},
                                  dimensions(order), {"tp": 1, "pp": pp, "dp": dp})


def grid_place(order: str, pp: int, dp: int, rank: int) -> tuple[int, int]:
    """``(replica, pipe_rank)`` of global ``rank``: the inverse of `grid_rank`."""
    coords = rank_order.coordinates(rank, dimensions(order), {"tp": 1, "pp": pp, "dp": dp})
    return coords["dp"], coords["pp"]


@dataclass(frozen=True)
class Mesh:
    """This process's place on the ``tp × pp × dp`` mesh and the groups it talks through."""

    pp: int
    dp: int
    rank: int
    replica: int                                 # its coordinate on dp
    pipe_rank: int                               # its coordinate on pp
    device: torch.device
    timeout: float                               # seconds any single wait may take
    dp_group: dist.ProcessGroup | None           # same stages, other replicas; None if dp = 1
    pipe_group: dist.ProcessGroup | None         # this line's pipeline; None if pp = 1
    clock_zero: float
    order: str = "replica-major"                 # how global ranks fill the mesh
    # (src, dst) pipe ranks -> the 2-rank group carrying src's messages to dst
    channels: dict[tuple[int, int], dist.ProcessGroup] = field(default_factory=dict)
    connected: set[tuple[int, int]] = field(default_factory=set)   # every line's, too
    tp: int = 1
    tp_rank: int = 0                             # its coordinate on tp
    tp_group: dist.ProcessGroup | None = None    # same stages, same replica; None if tp = 1
    # the groups as a DeviceMesh, dimensions named "pp", "dp", "tp" (those of size > 1,
    # slowest first); None when neither tp nor dp is above 1
    device_mesh: DeviceMesh | None = None
    # the most by which two ranks' clocks can disagree (seconds): see `init_mesh`
    clock_spread: float = 0.0

    @property
    def sizes(self) -> dict[str, int]:
        return {"tp": self.tp, "pp": self.pp, "dp": self.dp}

    def at(self, tp_rank: int, pipe_rank: int, replica: int) -> int:
        """The global rank at these coordinates."""
        return rank_order.global_rank({"tp": tp_rank, "pp": pipe_rank, "dp": replica},
                                      dimensions(self.order), self.sizes)

    def global_rank(self, pipe_rank: int) -> int:
        """The global rank of ``pipe_rank`` in this process's pipeline line (its replica
        and tp rank)."""
        return self.at(self.tp_rank, pipe_rank, self.replica)

    def channel(self, src: int, dst: int) -> dist.ProcessGroup:
        """The group carrying messages from pipe rank ``src`` to ``dst`` (one of them is
        this rank): made by `connect`."""
        return self.channels[(src, dst)]

    def connect(self, pairs: Iterable[tuple[int, int]]) -> None:
        """Make a channel for each ``(src, dst)`` pair of pipe ranks not connected yet, in
        every line (replica and tp rank). Collective: every rank calls it with the same
        pairs (a `DistributedPipe` does, with its lowered programs' `pairs`). Each
        channel's first message is sent here, in one order every rank follows: NCCL
        creates a communicator on its first operation and blocks until both ranks join,
        which, taken in any other order, could wait in a cycle; and a broken link fails
        now, not in the middle of a step."""
        new = sorted(set(pairs) - self.connected)
        wait = timedelta(seconds=self.timeout + CHANNEL_GRACE)
        for d in range(self.dp):   # new_group is collective: every rank makes every group
            for t in range(self.tp):
                for src, dst in new:
                    ranks = [self.at(t, p, d) for p in (src, dst)]
                    group = dist.new_group(ranks, timeout=wait)
                    if (d, t) == (self.replica, self.tp_rank) and self.pipe_rank in (src, dst):
                        self.channels[(src, dst)] = group
        self.connected.update(new)
        sends = []
        for src, dst in new:
            if self.pipe_rank not in (src, dst):
                continue
            probe = torch.zeros(1, device=self.device)
            group = self.channels[(src, dst)]
            if self.pipe_rank == src:
                sends.append(dist.isend(probe, self.global_rank(dst), group=group))
            else:
                dist.recv(probe, self.global_rank(src), group=group)
        for work in sends:
            work.wait()

    def clock(self) -> float:
        """Seconds since the mesh was made: every rank's clock started at one barrier, so
        events of different ranks can be drawn on one time axis, give or take
        ``clock_spread``."""
        return time.perf_counter() - self.clock_zero


def init_mesh(pp: int, dp: int = 1, timeout: float = 300.0,
              order: str = "replica-major", tp: int = 1) -> Mesh:
    """Lay the launched processes out as ``dp`` replicas of a ``pp``-rank pipeline whose
    stages are split over ``tp`` tensor-parallel ranks, their global ranks numbered in
    ``order`` ("replica-major" or "stage-major", or a `parallel.rank_order` string such
    as "tp-dp-pp"; see the module docstring), and create the process groups. Every rank
    must call it, with the same arguments."""
    if not dist.is_initialized():
        raise RuntimeError("init_mesh needs a process group: call it inside "
                           "`with pipeline_lib.distributed.process_group():`")
    dims = dimensions(order)
    check_same_everywhere("init_mesh arguments",   # (tp named where it is used)
                          dict(pp=pp, dp=dp, timeout=timeout, order=order)
                          | ({"tp": tp} if tp != 1 else {}))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if min(pp, dp, tp) < 1 or tp * pp * dp != world_size:
        raise ValueError(f"tp × pp × dp = {tp} × {pp} × {dp} must equal the number of "
                         f"processes, {world_size}: launch torchrun with --nproc_per_node "
                         f"(times --nnodes) = {tp * pp * dp}, or change --tp/--pp/--dp")
    sizes = {"tp": tp, "pp": pp, "dp": dp}
    mine = rank_order.coordinates(rank, dims, sizes)
    wait = timedelta(seconds=timeout)
    # new_group is collective: every rank creates every group, in the same order
    found: dict[str, dist.ProcessGroup | None] = {}
    for dim in ("dp", "pp", "tp"):
        found[dim] = None
        if sizes[dim] == 1:
            continue
        for ranks in rank_order.groups(dim, dims, sizes):
            group = dist.new_group(ranks, timeout=wait)
            if rank in ranks:
                found[dim] = group
    device = rank_device(dist.get_backend())
    clock_zero, clock_spread = _common_clock_zero(device)
    return Mesh(pp, dp, rank, mine["dp"], mine["pp"], device, timeout, found["dp"],
                found["pp"], clock_zero=clock_zero, order=order, tp=tp,
                tp_rank=mine["tp"], tp_group=found["tp"],
                device_mesh=_device_mesh(device.type, dims, sizes, found),
                clock_spread=clock_spread)


def _common_clock_zero(device: torch.device) -> tuple[float, float]:
    """Start every rank's clock as it leaves one barrier, and bound how far apart they
    started. Ranks leave a barrier at different instants (one is descheduled, a message
    arrives later); a second barrier bounds the spread: no rank leaves it before the last
    one has left the first, so the longest any rank spent between the two is at least
    the largest gap between two ranks' zeros."""
    dist.barrier()
    zero = time.perf_counter()
    dist.barrier()
    spread = torch.tensor([time.perf_counter() - zero], dtype=torch.float64, device=device)
    dist.all_reduce(spread, op=dist.ReduceOp.MAX)
    return zero, spread.item()


def _device_mesh(device_type: str, dims: str, sizes: dict[str, int],
                 groups: dict[str, dist.ProcessGroup | None]) -> DeviceMesh | None:
    """The groups of the dimensions of size > 1 as one `DeviceMesh` (slowest dimension
    first, as `rank_order.device_mesh` lays it out), for PyTorch's tensor-parallel plans
    and ``fully_shard``; its groups are the mesh's own (with its timeout)."""
    named = [d for d in reversed(dims.split("-")) if sizes[d] > 1]
    if not {"tp", "dp"} & set(named):
        return None
    # the global ranks by coordinates, slowest first (a dimension of size 1 changes
    # nothing in that order: it is left out)
    grid = torch.arange(sizes["tp"] * sizes["pp"] * sizes["dp"]).reshape(
        [sizes[d] for d in named])
    return DeviceMesh.from_group([groups[d] for d in named], device_type, mesh=grid,
                                 mesh_dim_names=tuple(named))
