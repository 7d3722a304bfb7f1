"""The processes of a multi-process pipeline, laid out in a ``dp × pp`` grid, and the
process groups they talk through. Every rank calls `init_mesh` (inside
`job.process_group`, which joins the torchrun job) with the same arguments.

``dp`` replicas of a ``pp``-rank pipeline. Two rank orders (``order=``):

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
"""
from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from pipeline_lib.distributed.launch import rank_device


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
# seconds a channel's own timeout adds to the mesh's: `p2p` names a wait that passes the
# mesh's timeout first, before NCCL's watchdog ends the process without a word on it
CHANNEL_GRACE = 30.0


def grid_rank(order: str, pp: int, dp: int, replica: int, pipe_rank: int) -> int:
    """The global rank of ``(replica, pipe_rank)`` in a ``dp × pp`` grid numbered in
    ``order`` (see the module docstring)."""
    if order == "replica-major":
        return replica * pp + pipe_rank
    if order == "stage-major":
        return pipe_rank * dp + replica
    raise ValueError(f"unknown rank order {order!r}: choose one of {RANK_ORDERS}")


def grid_place(order: str, pp: int, dp: int, rank: int) -> tuple[int, int]:
    """``(replica, pipe_rank)`` of global ``rank``: the inverse of `grid_rank`."""
    if order == "replica-major":
        return divmod(rank, pp)
    if order == "stage-major":
        pipe_rank, replica = divmod(rank, dp)
        return replica, pipe_rank
    raise ValueError(f"unknown rank order {order!r}: choose one of {RANK_ORDERS}")


@dataclass(frozen=True)
class Mesh:
    """This process's place in the ``dp × pp`` grid and the groups it talks through."""

    pp: int
    dp: int
    rank: int
    replica: int
    pipe_rank: int
    device: torch.device
    timeout: float                               # seconds any single wait may take
    dp_group: dist.ProcessGroup | None           # same stages, other replicas; None if dp = 1
    pipe_group: dist.ProcessGroup | None         # this replica's pipeline; None if pp = 1
    clock_zero: float
    order: str = "replica-major"                 # how global ranks fill the grid
    # (src, dst) pipe ranks -> the 2-rank group carrying src's messages to dst
    channels: dict[tuple[int, int], dist.ProcessGroup] = field(default_factory=dict)
    connected: set[tuple[int, int]] = field(default_factory=set)   # every replica's, too

    def global_rank(self, pipe_rank: int) -> int:
        """The global rank of ``pipe_rank`` in this process's replica."""
        return grid_rank(self.order, self.pp, self.dp, self.replica, pipe_rank)

    def channel(self, src: int, dst: int) -> dist.ProcessGroup:
        """The group carrying messages from pipe rank ``src`` to ``dst`` (one of them is
        this rank): made by `connect`."""
        return self.channels[(src, dst)]

    def connect(self, pairs: Iterable[tuple[int, int]]) -> None:
        """Make a channel for each ``(src, dst)`` pair of pipe ranks not connected yet, in
        every replica. Collective: every rank calls it with the same pairs (a
        `DistributedPipe` does, with its lowered programs' `pairs`). Each channel's first
        message is sent here, in one order every rank follows: NCCL creates a
        communicator on its first operation and blocks until both ranks join, which,
        taken in any other order, could wait in a cycle; and a broken link fails now, not
        in the middle of a step."""
        new = sorted(set(pairs) - self.connected)
        wait = timedelta(seconds=self.timeout + CHANNEL_GRACE)
        for d in range(self.dp):   # new_group is collective: every rank makes every group
            for src, dst in new:
                ranks = [grid_rank(self.order, self.pp, self.dp, d, p) for p in (src, dst)]
                group = dist.new_group(ranks, timeout=wait)
                if d == self.replica and self.pipe_rank in (src, dst):
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
        events of different ranks can be drawn on one time axis."""
        return time.perf_counter() - self.clock_zero


def init_mesh(pp: int, dp: int = 1, timeout: float = 300.0,
              order: str = "replica-major") -> Mesh:
    """Lay the launched processes out as ``dp`` replicas of a ``pp``-rank pipeline, their
    global ranks numbered in ``order`` ("replica-major" or "stage-major", see the module
    docstring), and create the process groups. Every rank must call it, with the same
    arguments."""
    if not dist.is_initialized():
        raise RuntimeError("init_mesh needs a process group: call it inside "
                           "`with pipeline_lib.distributed.process_group():`")
    if order not in RANK_ORDERS:
        raise ValueError(f"unknown rank order {order!r}: choose one of {RANK_ORDERS}")
    check_same_everywhere("init_mesh arguments", dict(pp=pp, dp=dp, timeout=timeout,
                                                      order=order))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if pp < 1 or dp < 1 or pp * dp != world_size:
        raise ValueError(f"pp × dp = {pp} × {dp} must equal the number of processes, "
                         f"{world_size}: launch torchrun with --nproc_per_node (times "
                         f"--nnodes) = {pp * dp}, or change --pp/--dp")
    replica, pipe_rank = grid_place(order, pp, dp, rank)

    def at(d: int, p: int) -> int:
        return grid_rank(order, pp, dp, d, p)

    wait = timedelta(seconds=timeout)
    # new_group is collective: every rank creates every group, in the same order
    dp_group = None
    if dp > 1:
        for p in range(pp):
            group = dist.new_group([at(d, p) for d in range(dp)], timeout=wait)
            if p == pipe_rank:
                dp_group = group
    pipe_group = None
    if pp > 1:
        for d in range(dp):
            group = dist.new_group([at(d, p) for p in range(pp)], timeout=wait)
            if d == replica:
                pipe_group = group
    device = rank_device(dist.get_backend())
    dist.barrier()
    return Mesh(pp, dp, rank, replica, pipe_rank, device, timeout, dp_group, pipe_group,
                clock_zero=time.perf_counter(), order=order)
