"""A `Cluster` for this machine, measured: the planner that prices a GPU cluster from its
spec sheet prices the CPU processes of the lessons from three measurements.

* one large float32 matrix multiply on ``threads`` threads: the peak FLOP/s;
* one large tensor copy: the memory bandwidth that norms, softmax and the optimizer see;
* a chain of tiny linear layers, forward and backward: what a kernel costs however small
  (module call, eager dispatch, autograd), most of a small model's step;
* gloo sends between two processes on this machine: the latency of a one-value message
  and the bandwidth of a large one (a "node" here is the machine, every rank on it).

Measured numbers are what they are: both efficiency factors are 1.
"""
from __future__ import annotations

import os
import socket
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pipeline_lib.plan.hardware import Cluster


def _best_seconds(run, repeats: int) -> float:
    run()                                        # warm up: allocation, thread pool
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


def matmul_flops(size: int = 1024, threads: int = 1, repeats: int = 5) -> float:
    """FLOP/s of one ``size``² × ``size``² float32 matrix multiply on ``threads`` threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a, b = torch.randn(size, size), torch.randn(size, size)
        return 2 * size ** 3 / _best_seconds(lambda: a @ b, repeats)
    finally:
        torch.set_num_threads(before)


def memory_bandwidth(nbytes: int = 256 * 2 ** 20, threads: int = 1, repeats: int = 5) -> float:
    """Bytes/s of one large copy (each byte read once and written once)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        source = torch.ones(nbytes // 4)
        target = torch.empty_like(source)
        return 2 * nbytes / _best_seconds(lambda: target.copy_(source), repeats)
    finally:
        torch.set_num_threads(before)


def kernel_overhead(chain: int = 100, threads: int = 1, repeats: int = 5) -> float:
    """Seconds per matrix multiply of a chain of 1 × 1 ``nn.Linear`` layers, forward and
    backward (three each: forward, input gradient, weight gradient): what a kernel costs
    however small, module call and autograd included, as a model's layers issue it."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        layers = torch.nn.Sequential(*[torch.nn.Linear(1, 1) for _ in range(chain)])
        x = torch.ones(1, 1)
        return _best_seconds(lambda: layers(x).sum().backward(), repeats) / (3 * chain)
    finally:
        torch.set_num_threads(before)


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
            times[name] = _best_seconds(trip, repeats) / 2
        if rank == 0:
            with open(out, "w") as f:
                f.write(f"{times['small']} {times['large']}")
    finally:
        dist.destroy_process_group()


def gloo_send(nbytes: int = 16 * 2 ** 20, repeats: int = 5) -> tuple[float, float]:
    """(latency s, bandwidth bytes/s) of a gloo send between two processes here: the
    latency is a one-value send, the bandwidth what a ``nbytes`` send adds to it."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "times")
        mp.start_processes(_ping_pong, args=(_free_port(), nbytes, repeats, out), nprocs=2,
                           start_method="spawn")
        with open(out) as f:
            small, large = map(float, f.read().split())
    return small, nbytes / max(large - small, 1e-9)


def measure_local_cluster(threads: int = 1, ranks: int = 2) -> Cluster:
    """This machine as a cluster of ``ranks`` CPU processes with ``threads`` intra-op
    threads each (bench/bench_distributed.py: 2 × 1), float32, one node, its memory
    shared by the ranks."""
    latency, bandwidth = gloo_send()
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / ranks
    return Cluster("this machine", peak_flops=matmul_flops(threads=threads),
                   hbm_bytes=memory, hbm_bandwidth=memory_bandwidth(threads=threads),
                   gpus_per_node=ranks, intra_node_bandwidth=bandwidth,
                   inter_node_bandwidth=bandwidth, matmul_efficiency=1.0,
                   bandwidth_efficiency=1.0, latency=latency, value_bytes=4,
                   kernel_overhead=kernel_overhead(threads=threads))
