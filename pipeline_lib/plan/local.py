"""A `Cluster` for this machine, measured: the planner that prices a GPU cluster from its
spec sheet prices the CPU processes of the lessons from three measurements.

* the model's own matrix multiplies at its micro-batch's shapes (or one large one) on
  ``threads`` threads: the peak FLOP/s that its step can reach;
* one large tensor copy: the memory bandwidth that norms, softmax and the optimizer see;
* a chain of tiny multiplies, forward and backward, its operations counted: what one
  dispatched operation costs however small (eager dispatch, autograd). A small model's
  step is mostly that, times the operations its modules dispatch (`count_dispatches`,
  counted once on the real modules and carried by `Model.dispatches`);
* gloo sends between two processes on this machine: the latency of a one-value message
  and the bandwidth of a large one (a "node" here is the machine, every rank on it); for
  the threaded `Pipe`, a queue hand-off between two threads.

Measured numbers are what they are: both efficiency factors are 1.
"""
from __future__ import annotations

import os
import queue
import socket
import statistics
import tempfile
import threading
import time
from dataclasses import replace
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from pipeline_lib.plan.costs import layer_pass
from pipeline_lib.plan.hardware import Cluster
from pipeline_lib.plan.model import Dispatches, Layout, Model


def _median_seconds(run, repeats: int) -> float:
    """The median of ``repeats`` timed runs after one to warm up (allocation, thread
    pool): the statistic the benchmarks report for the steps these numbers price, so a
    busy machine slows both alike (a best-of would see the machine idler than the
    steps did)."""
    run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def matmul_flops(size: int = 1024, threads: int = 1, repeats: int = 7) -> float:
    """FLOP/s of one ``size``² × ``size``² float32 matrix multiply on ``threads`` threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a, b = torch.randn(size, size), torch.randn(size, size)
        return 2 * size ** 3 / _median_seconds(lambda: a @ b, repeats)
    finally:
        torch.set_num_threads(before)


def memory_bandwidth(nbytes: int = 256 * 2 ** 20, threads: int = 1, repeats: int = 7) -> float:
    """Bytes/s of one large copy (each byte read once and written once)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        source = torch.ones(nbytes // 4)
        target = torch.empty_like(source)
        return 2 * nbytes / _median_seconds(lambda: target.copy_(source), repeats)
    finally:
        torch.set_num_threads(before)


class _Counter(TorchDispatchMode):
    """Counts the operations dispatched while it is on (forward and autograd's backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def dispatched(run: Callable[[], object]) -> int:
    """How many operations ``run`` dispatches."""
    with _Counter() as counter:
        run()
    return counter.count


def count_dispatches(model: nn.Sequential, ids: torch.Tensor, target: torch.Tensor,
                     loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
                     ) -> Dispatches:
    """Operations per micro-batch of ``Sequential(embedding, *blocks, head)`` (the
    lessons' `transformer_lm`), forward and backward, counted once on ``ids`` (one
    micro-batch) and ``target``: the embedding, one block, and the head with the loss."""
    embedding, block, head = model[0], model[1], model[-1]
    x = embedding(ids).detach().requires_grad_()

    def passes(forward: Callable[[], torch.Tensor]) -> tuple[int, int]:
        out: list[torch.Tensor] = []
        ops = dispatched(lambda: out.append(forward()))
        grad = torch.ones_like(out[0])
        return ops, dispatched(lambda: out[0].backward(grad))

    return Dispatches(block=passes(lambda: block(x)), embedding=passes(lambda: embedding(ids)),
                      head=passes(lambda: loss_fn(head(x), target)))


def kernel_overhead(chain: int = 200, threads: int = 1, repeats: int = 7) -> float:
    """Seconds per dispatched operation of a chain of tiny multiplies, forward and
    backward, each operation counted (`dispatched`): what an operation costs however
    small, eager dispatch and autograd bookkeeping included."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        x = torch.ones(1, requires_grad=True)

        def run() -> None:
            y = x
            for _ in range(chain):
                y = y * 1.0001
            y.sum().backward()
        return _median_seconds(run, repeats) / dispatched(run)
    finally:
        torch.set_num_threads(before)


def block_overhead(block: nn.Module, model: Model, cluster: Cluster,
                   repeats: int = 7) -> float:
    """Seconds per dispatched operation of ``model``'s own ``block``, forward and backward
    at one token: its measured time, less what the roofline prices at that size (mostly
    its weights' traffic), over the operations it dispatches. Unlike a chain of bare
    operations this includes what the block's modules do in Python around each one
    (argument checks, module calls), which a small model pays on every operation."""
    x = torch.randn(1, 1, model.hidden, requires_grad=True)

    def run() -> None:
        block(x).sum().backward()
    seconds = _median_seconds(run, repeats)
    layer, _ = layer_pass(replace(model, seq_len=1, dispatches=None),
                          replace(cluster, kernel_overhead=0.0), Layout(flash_attention=True))
    priced = layer.forward + layer.input_grad + layer.weight_grad
    return max(seconds - priced, 0.0) / dispatched(run)


def model_matmul_flops(model: Model, micro_batch: int, threads: int = 1,
                       repeats: int = 7) -> float:
    """FLOP/s of ``model``'s own forward matrix multiplies at ``micro_batch`` sequences
    (a block's query-key-value, output, and MLP projections, each block, and the
    vocabulary projection): a small model's multiplies reach far less than a large
    square one's, so this, not `matmul_flops`, is the peak its step sees."""
    tokens, h, f = micro_batch * model.seq_len, model.hidden, model.ffn
    shapes = [(tokens, h, model.qkv_width), (tokens, h, h), (tokens, h, f),
              (tokens, f, h)] * model.layers + [(tokens, h, model.vocab)]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        pairs = [(torch.randn(m, k), torch.randn(k, n)) for m, k, n in shapes]
        flops = sum(2 * m * k * n for m, k, n in shapes)
        return flops / _median_seconds(lambda: [a @ b for a, b in pairs], repeats)
    finally:
        torch.set_num_threads(before)


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


def _ping_pong(rank: int, port: int, nbytes: int, repeats: int, out: str) -> None:
    """Rank 0 sends a tensor, rank 1 sends it back; half the round trip is one send."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        times = {}
        for name, size in (("small", 1), ("large", nbytes // 4)):
            buffer = torch.zeros(size)

            def trip() -> None:
                if rank == 0:
                    dist.send(buffer, 1)
                    dist.recv(buffer, 1)
                else:
                    dist.recv(buffer, 0)
                    dist.send(buffer, 0)
            times[name] = _median_seconds(trip, repeats) / 2
        if rank == 0:
            with open(out, "w") as f:
                f.write(f"{times['small']} {times['large']}")
    finally:
        dist.destroy_process_group()


def gloo_send(nbytes: int = 16 * 2 ** 20, repeats: int = 7) -> tuple[float, float]:
    """(latency s, bandwidth bytes/s) of a gloo send between two processes here: the
    latency is a one-value send, the bandwidth what a ``nbytes`` send adds to it."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "times")
        mp.start_processes(_ping_pong, args=(_free_port(), nbytes, repeats, out), nprocs=2,
                           start_method="spawn")
        with open(out) as f:
            small, large = map(float, f.read().split())
    return small, nbytes / max(large - small, 1e-9)


def measure_local_cluster(threads: int = 1, ranks: int = 2, model: Model | None = None,
                          micro_batch: int = 1, transport: str = "gloo",
                          block: nn.Module | None = None) -> Cluster:
    """This machine as a cluster of ``ranks`` CPU processes (``transport="gloo"``,
    bench/bench_distributed.py) or stage threads of one process (``"threads"``, the
    threaded `Pipe`), ``threads`` intra-op threads each, float32, one node, its memory
    shared by the ranks. With ``model``, the peak FLOP/s is that of its own matrix
    multiplies at ``micro_batch`` sequences (`model_matmul_flops`), else of one large one;
    with its torch ``block`` too, the cost per operation is that block's
    (`block_overhead`), else a chain of bare operations' (`kernel_overhead`)."""
    if transport not in ("gloo", "threads"):
        raise ValueError(f"transport must be 'gloo' (processes) or 'threads', not {transport!r}")
    bandwidth = memory_bandwidth(threads=threads)
    if transport == "gloo":
        latency, link = gloo_send()
    else:
        latency, link = thread_handoff(), bandwidth    # nothing is copied: no bytes to move
    peak = matmul_flops(threads=threads) if model is None else \
        model_matmul_flops(model, micro_batch, threads=threads)
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / ranks
    cluster = Cluster("this machine", peak_flops=peak, hbm_bytes=memory,
                      hbm_bandwidth=bandwidth, gpus_per_node=ranks,
                      intra_node_bandwidth=link, inter_node_bandwidth=link,
                      matmul_efficiency=1.0, bandwidth_efficiency=1.0, latency=latency,
                      value_bytes=4, kernel_overhead=kernel_overhead(threads=threads))
    if model is None or block is None:
        return cluster
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return replace(cluster, kernel_overhead=block_overhead(block, model, cluster))
    finally:
        torch.set_num_threads(before)
