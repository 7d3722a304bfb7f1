"""The processes of a multi-process pipeline: how they start, how they are laid out in a
``dp × pp`` grid, and how a failure on one rank stops them all with its reason.

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
torchrun already stops a job on one machine: once a worker exits with an error, it
terminates the others. `process_group` adds the reason, and the one case torchrun misses:

* A rank whose code raises writes ``rank N failed: ...`` into the c10d store, then exits.
  A rank that fails only because a peer vanished (a closed connection) names that entry
  rather than blaming itself; with no entry, the peer died without a word (killed, e.g.
  by the out-of-memory killer): ``rank N lost``.
* Ranks that disagree are named rather than left to time out with gloo's "Timed out
  waiting ... for recv": `init_mesh` compares its arguments across ranks, and a rank that
  leaves the block marks it in the store, so a rank still waiting for it can say that the
  ranks ran different numbers of steps.
* **The watchdog, only across machines.** torchrun on another machine does not stop its
  workers when one elsewhere fails; they would wait for the lost peer until ``timeout``
  (NCCL does not even notice a vanished peer before then). So in a job that spans
  machines a thread polls the store and stops its rank as soon as another reports a
  failure.
"""
from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Iterator, NoReturn

import torch
import torch.distributed as dist

from pipeline_lib.distributed.launch import backend_for, worker_device


class RankLost(RuntimeError):
    """A peer's process ended without reporting an error: its connection closed."""

    def __init__(self, rank: int, doing: str):
        super().__init__(f"rank {rank} lost: its process ended without reporting an error "
                         f"(killed, e.g. by the out-of-memory killer?) while {doing}")
        self.rank, self.doing = rank, doing


def connection_closed(exc: BaseException) -> bool:
    """Whether a communication error means that the peer's process is gone (gloo's and
    NCCL's words for it)."""
    return any(words in str(exc) for words in ("Connection closed by peer",
                                                "Connection reset by peer",
                                                "remote process exited"))


def _exit(message: str) -> NoReturn:
    """Leave now: pending point-to-point work can block a normal interpreter shutdown."""
    print(message, file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(1)


class _Board:
    """Keys in the c10d store where each rank says how it ended: ``failed/rank{r}`` holds
    its error, ``finished/rank{r}`` says that it has left the ``process_group`` block."""

    def __init__(self, store: dist.Store, rank: int, world_size: int):
        self.store = dist.PrefixStore("pipeline_lib/", store)
        self.rank, self.world_size = rank, world_size
        self.finishing = False

    def ranks(self, kind: str) -> list[int]:
        return [r for r in range(self.world_size) if self.store.check([f"{kind}/rank{r}"])]

    def failures(self) -> list[str]:
        """What the other ranks that failed said."""
        return [self.store.get(f"failed/rank{r}").decode() for r in self.ranks("failed")
                if r != self.rank]

    def fail(self, exc: BaseException) -> NoReturn:
        """Print and publish why this rank stops, then exit. If another rank failed
        first, ours is most likely a consequence (a closed connection): name theirs."""
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, signal.SIG_IGN)   # torchrun: let us finish the sentence
        here = exc.doing if isinstance(exc, RankLost) else f"{type(exc).__name__}: {exc}"
        with contextlib.suppress(Exception):   # the store may have gone with its machine
            if others := self.failures():
                _exit(f"rank {self.rank}: stopping because {'; '.join(others)} (here: {here})")
        traceback.print_exception(exc)
        mine = self._reason(exc, here)
        with contextlib.suppress(Exception):
            self.store.set(f"failed/rank{self.rank}", mine)
        _exit(mine)

    def _reason(self, exc: BaseException, here: str) -> str:
        if isinstance(exc, RankLost):
            return str(exc)
        if connection_closed(exc):
            return (f"a rank was lost: its process ended without reporting an error (killed, "
                    f"e.g. by the out-of-memory killer?); rank {self.rank} noticed: {here}")
        notes = getattr(exc, "__notes__", [])
        reason = f"rank {self.rank} failed: {here}" + (f" ({'; '.join(notes)})" if notes else "")
        with contextlib.suppress(Exception):
            finished = self.ranks("finished")
            timed_out = "timed out" in here.lower() or "timeout" in here.lower()
            if finished and timed_out and not self.finishing:
                reason += (f"; ranks {finished} had already finished their work: the ranks "
                           f"ran different numbers of steps (or collectives)")
        return reason

    def finish(self, timeout: float) -> None:
        """A barrier through the store, which can say who did not arrive."""
        self.finishing = True
        self.store.set(f"finished/rank{self.rank}", "")
        try:
            self.store.wait([f"finished/rank{r}" for r in range(self.world_size)],
                            timedelta(seconds=timeout))
        except Exception:  # noqa: BLE001 - the store's timeout: say who is missing
            missing = sorted(set(range(self.world_size)) - set(self.ranks("finished")))
            raise TimeoutError(
                f"rank {self.rank} finished its work, but ranks {missing} had not {timeout:g} s "
                f"later: they are still computing (raise the timeout), or wait for messages "
                f"that finished ranks will never send (did the ranks run different numbers "
                f"of steps?)") from None

    def watch(self, poll: float = 0.1) -> None:
        """The watchdog of a job across machines (see the module docstring)."""
        while True:
            time.sleep(poll)
            try:
                failed = self.failures()
            except Exception as exc:  # noqa: BLE001 - the store went with its machine
                if not self.finishing:
                    _exit(f"rank {self.rank}: lost contact with the other ranks "
                          f"(c10d store: {exc}); stopping")
                return
            if failed:
                _exit(f"rank {self.rank}: stopping because " + "; ".join(failed))


@contextlib.contextmanager
def process_group(backend: str | None = None, timeout: float = 300.0) -> Iterator[None]:
    """Join the process group torchrun set up (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
    ...) for the block, then leave it once every rank has finished. The backend is NCCL
    if every worker on this machine has a GPU (`launch.worker_device`), else gloo.

    If the block raises on any rank, that rank prints and publishes why and exits with
    status 1, and every other rank stops (see the module docstring). ``timeout`` bounds
    rendezvous, every wait, and how long a finished rank waits for the others.
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
    board = _Board(store, rank, world_size)
    if int(os.environ.get("LOCAL_WORLD_SIZE", world_size)) < world_size:   # several machines
        threading.Thread(target=board.watch, name="pipeline-watchdog", daemon=True).start()
    try:
        yield
        board.finish(timeout)
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the other ranks
        board.fail(exc)
    dist.destroy_process_group()


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
    check_same_everywhere("init_mesh arguments", dict(pp=pp, dp=dp, timeout=timeout))
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
    _connect(links, replica * pp, pipe_rank, device)
    dist.barrier()
    return Mesh(pp, dp, rank, replica, pipe_rank, device, timeout, dp_group, links,
                clock_zero=time.perf_counter())


def _connect(links: dict[tuple[int, int], dist.ProcessGroup], first_rank: int,
             me: int, device: torch.device) -> None:
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
            dist.recv(probe, first_rank + src, group=links[(src, dst)])
    for work in sends:
        work.wait()
