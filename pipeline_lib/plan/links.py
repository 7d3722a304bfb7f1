"""What messages cost between the ranks of this machine, measured: gloo sends between
two processes (latency, bandwidth, and what a message costs the cores at its two ends),
or a queue hand-off between two threads of one process (the threaded `Pipe`).
"""
from __future__ import annotations

import os
import queue
import socket
import statistics
import tempfile
import threading
import time
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from pipeline_lib.distributed.p2p import encode
from pipeline_lib.lowering import Message
from pipeline_lib.plan.measure import block_work, median_seconds


def _resume_cost(work: Callable[[], None], exchange: Callable[[], None],
                 agree: Callable[[int], int] = lambda n: n, budget: float = 1.0) -> float:
    """How much longer ``work`` takes when each run follows an ``exchange`` of messages
    with another rank, as a pipeline runs its actions, than run after run alone
    (medians; about ``budget`` seconds each way; ``agree`` makes the ranks run as many
    exchanges)."""
    work()
    start = time.perf_counter()
    work()
    repeats = agree(int(min(200, max(5, budget / max(time.perf_counter() - start, 1e-6)))))
    times: dict[str, list[float]] = {"alone": [], "between": []}
    for name in times:
        for _ in range(repeats):
            if name == "between":
                exchange()
            start = time.perf_counter()
            work()
            times[name].append(time.perf_counter() - start)
    return max(statistics.median(times["between"]) - statistics.median(times["alone"]), 0.0)


def thread_handoff(repeats: int = 200) -> float:
    """Seconds for one tensor to pass from one thread to another through a queue (half a
    round trip): the message latency between the threaded `Pipe`'s stage threads, which
    share one process's memory and copy nothing."""
    there: queue.Queue = queue.Queue()
    back: queue.Queue = queue.Queue()
    x = torch.ones(1)

    def echo() -> None:
        for _ in range(repeats + 1):
            back.put(there.get())
    worker = threading.Thread(target=echo, daemon=True)
    worker.start()
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        there.put(x)
        back.get()
        times.append(time.perf_counter() - start)
    worker.join()
    return statistics.median(times[1:]) / 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _half_round_trip(rank: int, values: int, repeats: int) -> float:
    """Rank 0 sends ``values`` floats, rank 1 sends them back: half of that is one send."""
    buffer = torch.zeros(values)

    def trip() -> None:
        if rank == 0:
            dist.send(buffer, 1)
            dist.recv(buffer, 1)
        else:
            dist.recv(buffer, 0)
            dist.send(buffer, 0)
    return median_seconds(trip, repeats) / 2


def _message(message_bytes: int) -> list[torch.Tensor]:
    """The tensors of a steady step's message: one float32 tensor of ``message_bytes``
    (`p2p.PostedEarly` sends a layout only in the first step of a batch shape)."""
    return [torch.zeros(message_bytes // 4)]


def _send_cost(rank: int, message_bytes: int, repeats: int) -> float:
    """What sending a message costs rank 0's core in a steady step: encoding it and
    checking its layout against the agreed one, then starting its send into a receive
    that rank 1 posted before it, as `p2p.PostedEarly.send` does (rank 1 returns 0)."""
    sends, [activation] = [], _message(message_bytes)
    agreed, _ = encode(Message("activation", 1, 0, 0), activation)
    for _ in range(repeats):
        works = [dist.irecv(t, 0) for t in _message(message_bytes)] if rank == 1 else []
        dist.barrier()
        time.sleep(0.001)           # the receives are posted before the sends start
        if rank == 0:
            start = time.perf_counter()
            layout, tensors = encode(Message("activation", 1, 0, 0), activation)
            if layout != agreed:
                raise AssertionError("a steady message changed its layout")
            works = [dist.isend(t, 1) for t in tensors]
            sends.append(time.perf_counter() - start)
        for work in works:
            work.wait()
    return statistics.median(sends) if sends else 0.0


def _receive_cost(rank: int, message_bytes: int, block: nn.Module,
                  shape: tuple[int, ...]) -> float:
    """What a message costs its receiver (`_resume_cost`): both ranks run ``block``
    forward and backward on a micro-batch of ``shape``, alone, then each run between two
    exchanges of messages of ``message_bytes``, receives posted early."""
    peer, outgoing, incoming = 1 - rank, _message(message_bytes), _message(message_bytes)
    posted = [dist.irecv(t, peer) for t in incoming]

    def exchange() -> None:
        nonlocal posted
        sent = [dist.isend(t, peer) for t in outgoing]
        for work in posted + sent:
            work.wait()
        posted = [dist.irecv(t, peer) for t in incoming]

    def fewest(n: int) -> int:
        counts = torch.tensor([n])
        dist.all_reduce(counts, op=dist.ReduceOp.MIN)
        return int(counts)
    resume = _resume_cost(block_work(block, shape), exchange, fewest)
    dist.barrier()
    for t in outgoing:                   # answer the last receives posted
        dist.send(t, peer)
    for work in posted:
        work.wait()
    return resume


def _ping_pong(rank: int, port: int, nbytes: int, message_bytes: int, repeats: int,
               block: nn.Module | None, shape: tuple[int, ...], out: str) -> None:
    """One of two gloo processes: a one-value and an ``nbytes`` round trip, what a
    message costs its sender, and with a ``block`` what it costs its receiver; rank 0
    writes them to ``out``."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        small = _half_round_trip(rank, 1, repeats)
        large = _half_round_trip(rank, nbytes // 4, repeats)
        sent = _send_cost(rank, message_bytes, 4 * repeats)
        resume = 0.0 if block is None else _receive_cost(rank, message_bytes, block, shape)
        if rank == 0:
            with open(out, "w") as f:
                f.write(f"{small} {large} {sent} {resume}")
    finally:
        dist.destroy_process_group()


def gloo_send(nbytes: int = 16 * 2 ** 20, message_bytes: int = 4, repeats: int = 7,
              block: nn.Module | None = None, shape: tuple[int, ...] = ()
              ) -> tuple[float, float, float, float]:
    """(latency s, bandwidth bytes/s, send overhead s, receive overhead s) of gloo sends
    between two processes here. The send overhead is what a message of
    ``message_bytes`` costs its sender's core in a steady step; the latency is a
    one-value send's time, and the bandwidth what a ``nbytes`` send adds to it. The
    receive overhead is what resuming ``block``'s work after a message costs the
    receiver (0 without a block)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "times")
        mp.start_processes(_ping_pong, args=(_free_port(), nbytes, message_bytes, repeats,
                                             block, shape, out),
                           nprocs=2, start_method="spawn")
        with open(out) as f:
            small, large, sent, resume = map(float, f.read().split())
    return small, nbytes / max(large - small, 1e-9), sent, resume
