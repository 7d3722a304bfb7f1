"""One rank's view of the torchrun job: join it (`process_group`), leave it once every
rank is done, and when a rank fails, stop every rank with that rank's reason.

torchrun already stops a job on one machine: once a worker exits with an error, it
terminates the others. `process_group` adds the reason, and the one case torchrun misses:

* A rank whose code raises writes ``rank N failed: ...`` into the c10d store, then exits.
  A rank that fails only because a peer vanished (a closed connection) names that entry
  rather than blaming itself; with no entry, the peer died without a word (killed, e.g.
  by the out-of-memory killer): ``rank N lost``.
* Ranks that disagree are named rather than left to time out with gloo's "Timed out
  waiting ... for recv": `mesh.init_mesh` compares its arguments across ranks, and a rank that
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
from datetime import timedelta
from typing import Iterator, NoReturn

import torch.distributed as dist

from pipeline_lib.distributed.launch import announce, backend_for, worker_placement


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
    if every worker has a GPU of its own (`launch.choose_device`: one per worker on this
    machine, or its task's one visible GPU), else gloo; ``backend="nccl"`` (or
    ``PIPELINE_LIB_DEVICE=cuda``) stops, saying why, where that cannot be. Before the
    group exists, this rank's GPU is made the current device, so NCCL's communicators
    and every ``"cuda"`` tensor land on the rank's own GPU, and rank 0 prints where every
    rank computes and why (`launch.announce`, which also refuses a GPU two ranks share).

    If the block raises on any rank, that rank prints and publishes why and exits with
    status 1, and every other rank stops (see the module docstring). ``timeout`` bounds
    rendezvous, every wait, and how long a finished rank waits for the others.
    """
    missing = [v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
               if v not in os.environ]
    if missing:
        raise RuntimeError(f"environment variables {missing} are not set: start this "
                           f"program with torchrun, e.g. torchrun --nproc_per_node 2 ...")
    # this rank's GPU is pinned now: NCCL binds to the current device
    placement = worker_placement({"nccl": "cuda", "gloo": "cpu"}.get(backend or ""))
    backend = backend or backend_for(placement.device)
    wait = timedelta(seconds=timeout)
    store, rank, world_size = next(dist.rendezvous("env://", timeout=wait))
    announce(store, rank, world_size, backend, placement, timeout)
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
