"""The processes of a multi-process pipeline: how they start, how they are laid out in a
``dp × pp`` grid, and how one rank's failure stops them all.

Layout
------
``dp`` replicas of a ``pp``-rank pipeline; global rank ``replica * pp + pipe_rank``::

    pp = 4, dp = 2     pipe rank:  0   1   2   3
                       replica 0:  0   1   2   3      <- one pipeline
                       replica 1:  4   5   6   7      <- another, fed other rows

Pipeline neighbours are adjacent ranks, so with ``torchrun --nproc_per_node pp`` each
pipeline's point-to-point traffic (every micro-batch, both ways) stays inside one node
and only data parallelism's gradient all-reduce (once per step) crosses nodes. The
ranks holding the same stages (a column above) form a data-parallel group; each pair of
pipeline neighbours gets one 2-rank group per direction (see `pipeline_lib.distributed`
for why).

Failures
--------
A rank that raises while its peers wait for its messages must not leave them hanging
until a timeout. Inside `process_group`, a failing rank writes its error into the c10d
store and exits; every rank runs a watchdog thread that polls the store and, on seeing a
failure, prints which rank failed and why and exits too. torchrun then sees non-zero exit
codes and tears the group down. Waits still time out (``timeout``) for what the store
cannot see, such as a rank killed by the OOM killer.
"""
from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Iterator, NoReturn

import torch
import torch.distributed as dist

from pipeline_lib.distributed.launch import backend_for, worker_device

_FAILURES = "pipeline_lib/failures/"


def _exit(message: str) -> NoReturn:
    """Leave now: pending point-to-point work can block a normal interpreter shutdown."""
    if message:
        print(message, file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(1)


class _Watchdog(threading.Thread):
    """Turns any rank's failure into every rank's exit."""

    def __init__(self, store: dist.Store, rank: int, world_size: int, poll: float = 0.1):
        super().__init__(name="pipeline-watchdog", daemon=True)
        self.store = dist.PrefixStore(_FAILURES, store)
        self.rank, self.world_size, self.poll = rank, world_size, poll
        self.stopped = threading.Event()

    def failures(self) -> list[str]:
        return [self.store.get(f"rank{r}").decode() for r in range(self.world_size)
                if self.store.check([f"rank{r}"])]

    def run(self) -> None:
        while not self.stopped.wait(self.poll):
            try:
                failed = self.store.check(["count"])
                reasons = self.failures() if failed else []
            except Exception as exc:  # noqa: BLE001 - any store error means the group is gone
                if not self.stopped.is_set():
                    _exit(f"rank {self.rank}: lost contact with the other ranks "
                          f"(c10d store: {exc}); stopping")
                return
            if failed and not self.stopped.is_set():
                print(f"rank {self.rank}: stopping because " + "; ".join(reasons),
                      file=sys.stderr, flush=True)
                with contextlib.suppress(Exception):
                    self.store.add("acknowledged", 1)
                _exit("")

    def report(self, exc: BaseException) -> NoReturn:
        """Called on a rank whose work raised: publish the error, then exit. If another
        rank failed first, ours is most likely a consequence (a closed connection): name
        theirs instead."""
        self.stopped.set()
        here = f"{type(exc).__name__}: {exc}"
        try:
            others = self.failures()
        except Exception:  # noqa: BLE001 - store gone with its host: torchrun stops the rest
            others = []
        if others:
            _exit(f"rank {self.rank}: stopping because " + "; ".join(others)
                  + f" (here: {here})")
        traceback.print_exception(exc)
        notes = getattr(exc, "__notes__", [])
        mine = f"rank {self.rank} failed: {here}" + (f" ({'; '.join(notes)})" if notes else "")
        print(mine, file=sys.stderr, flush=True)
        with contextlib.suppress(Exception):
            self.store.set(f"rank{self.rank}", mine)
            self.store.add("count", 1)
            # Stay until every other rank has said why it stops (a few seconds at most):
            # once this process exits, torchrun kills the others, perhaps mid-sentence.
            deadline = time.monotonic() + 10.0
            while (self.store.add("acknowledged", 0) < self.world_size - 1
                   and time.monotonic() < deadline):
                time.sleep(self.poll)
        _exit("")


@contextlib.contextmanager
def process_group(backend: str | None = None, timeout: float = 300.0) -> Iterator[None]:
    """Join the process group torchrun set up (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
    ...), watch for failures until the block ends, then leave cleanly. The backend is
    NCCL if every worker on this machine has a GPU (`launch.worker_device`), else gloo.

    If the block raises on any rank, every rank exits (status 1) with a message naming the
    failing rank and its error. ``timeout`` bounds rendezvous and process-group creation.
    """
    missing = [v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
               if v not in os.environ]
    if missing:
        raise RuntimeError(f"environment variables {missing} are not set: start this "
                           f"program with torchrun, e.g. torchrun --nproc_per_node 2 ...")
    backend = backend or backend_for(worker_device())
    wait = timedelta(seconds=timeout)
    store, rank, world_size = next(dist.rendezvous("env://", timeout=wait))
    dist.init_process_group(backend, store=dist.PrefixStore("pipeline_lib/pg", store),
                            rank=rank, world_size=world_size, timeout=wait)
    watchdog = _Watchdog(store, rank, world_size)
    watchdog.start()
    try:
        yield
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the other ranks
        watchdog.report(exc)
    dist.barrier()          # nobody tears down the store while others still use it
    watchdog.stopped.set()
    dist.destroy_process_group()


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
    links: dict[tuple[int, int], dist.ProcessGroup]  # (src, dst) pipe ranks -> 2-rank group
    clock_zero: float

    def global_rank(self, pipe_rank: int) -> int:
        """The global rank of ``pipe_rank`` in this process's replica."""
        return self.replica * self.pp + pipe_rank

    def link(self, src: int, dst: int) -> dist.ProcessGroup:
        """The group carrying messages from pipe rank ``src`` to ``dst`` (one of them is
        this rank)."""
        return self.links[(src, dst)]

    def clock(self) -> float:
        """Seconds since the mesh was made: every rank's clock started at one barrier, so
        events of different ranks can be drawn on one time axis."""
        return time.perf_counter() - self.clock_zero


def _neighbour_pairs(pp: int) -> list[tuple[int, int]]:
    """Ordered pairs of pipe ranks that talk: ring neighbours, both directions. The ring
    closes (pp-1 -> 0) because interleaved schedules send stage pp-1's output to stage pp,
    which lives on rank 0."""
    if pp == 1:
        return []
    edges = [(r, r + 1) for r in range(pp - 1)] + ([(pp - 1, 0)] if pp > 2 else [])
    return [pair for a, b in edges for pair in ((a, b), (b, a))]


def init_mesh(pp: int, dp: int = 1, timeout: float = 300.0) -> Mesh:
    """Lay the launched processes out as ``dp`` replicas of a ``pp``-rank pipeline and
    create the process groups. Every rank must call it, with the same arguments."""
    if not dist.is_initialized():
        raise RuntimeError("init_mesh needs a process group: call it inside "
                           "`with pipeline_lib.distributed.mesh.process_group():`")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if pp < 1 or dp < 1 or pp * dp != world_size:
        raise ValueError(f"pp × dp = {pp} × {dp} must equal the number of processes, "
                         f"{world_size}: launch torchrun with --nproc_per_node (times "
                         f"--nnodes) = {pp * dp}, or change --pp/--dp")
    replica, pipe_rank = divmod(rank, pp)
    wait = timedelta(seconds=timeout)
    # new_group is collective: every rank creates every group, in the same order
    dp_group = None
    if dp > 1:
        for p in range(pp):
            group = dist.new_group([d * pp + p for d in range(dp)], timeout=wait)
            if p == pipe_rank:
                dp_group = group
    device = (torch.device("cuda", torch.cuda.current_device())
              if dist.get_backend() == "nccl" else torch.device("cpu"))
    links = {}
    for d in range(dp):
        for src, dst in _neighbour_pairs(pp):
            group = dist.new_group([d * pp + src, d * pp + dst], timeout=wait)
            if d == replica and pipe_rank in (src, dst):
                links[(src, dst)] = group
    _connect(links, replica * pp, pipe_rank, device, wait)
    dist.barrier()
    return Mesh(pp, dp, rank, replica, pipe_rank, device, timeout, dp_group, links,
                clock_zero=time.perf_counter())


def _connect(links: dict[tuple[int, int], dist.ProcessGroup], first_rank: int,
             me: int, device: torch.device, wait: timedelta) -> None:
    """Send one tiny message over every link, in one global order. NCCL creates a
    communicator on a group's first operation and blocks the sender until the receiver
    joins; doing it here, in an order every rank follows, cannot deadlock, and a broken
    link fails now rather than in the middle of a step."""
    sends = []
    for src, dst in sorted(links):
        probe = torch.zeros(1, device=device)
        if me == src:
            sends.append(dist.isend(probe, first_rank + dst, group=links[(src, dst)]))
        else:
            dist.irecv(probe, first_rank + src, group=links[(src, dst)]).wait(wait)
    for work in sends:
        work.wait(wait)
