"""A `Cluster` for this machine, measured: the planner that prices a GPU cluster from its
spec sheet prices the CPU processes (or threads) of the lessons from measurements of
what each kind of work costs here: `plan.measure` (operations, multiplies, bytes, the
executor's actions) and `plan.links` (messages). A small model's step is mostly what
its operations cost however small, times the operations its modules dispatch
(`plan.kernels.count_kernels`, carried by `Model.kernels`). Measured numbers are what
they are: both efficiency factors are 1.
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import replace

from torch import nn

from pipeline_lib.plan.hardware import Cluster
from pipeline_lib.plan.links import gloo_send, thread_handoff
from pipeline_lib.plan.measure import (action_overhead, block_overhead, busy_peer,
                                       kernel_overhead, matmul_flops, memory_bandwidth,
                                       model_matmul_flops, model_memory_bandwidth,
                                       with_threads)
from pipeline_lib.plan.model import Model


def measure_local_cluster(threads: int = 1, ranks: int = 2, model: Model | None = None,
                          micro_batch: int = 1, transport: str = "gloo",
                          block: nn.Module | None = None) -> Cluster:
    """This machine as a cluster of ``ranks`` CPU processes (``transport="gloo"``,
    bench/bench_distributed.py) or stage threads of one process (``"threads"``, the
    threaded `Pipe`), ``threads`` intra-op threads each, float32, one node, its memory
    shared by the ranks. With ``model``, the FLOP/s are those of its own multiplies at
    ``micro_batch`` sequences (`model_matmul_flops`) and the send overhead that of its
    activation's message, else those of one large multiply and one large copy. With its
    torch ``block`` too, the bytes' rate (`model_memory_bandwidth`) and the cost per
    operation (`block_overhead`) are that block's, and the receive overhead what
    resuming it after a message costs; else a large copy's, a chain of bare operations'
    (`kernel_overhead`), and 0. With ``"threads"`` and a block, compute is measured
    with another thread running the block (`busy_peer`), as the other stage's does."""
    if transport not in ("gloo", "threads"):
        raise ValueError(f"transport must be 'gloo' (processes) or 'threads', not {transport!r}")
    shape = (micro_batch, model.seq_len, model.hidden) if model is not None else ()

    def computing() -> contextlib.AbstractContextManager[None]:
        threaded = transport == "threads" and block is not None and model is not None
        return busy_peer(block, shape) if threaded else contextlib.nullcontext()

    with computing():
        if model is None:
            peak, bandwidth = matmul_flops(threads=threads), memory_bandwidth(threads=threads)
        else:
            peak = model_matmul_flops(model, micro_batch, threads=threads)
            bandwidth = memory_bandwidth(threads=threads) if block is None else \
                model_memory_bandwidth(model, micro_batch, block, peak, threads=threads)
        per_op, per_action = kernel_overhead(threads=threads), with_threads(threads,
                                                                            action_overhead)
    if transport == "gloo":
        message = 4 * micro_batch * model.seq_len * model.hidden if model is not None else 4
        latency, link, send, receive = gloo_send(message_bytes=message, block=block,
                                                 shape=shape)
    else:     # nothing is copied: no bytes to move, and a hand-off is all of it
        latency, link, send, receive = thread_handoff(), bandwidth, 0.0, 0.0
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / ranks
    cluster = Cluster("this machine", peak_flops=peak, hbm_bytes=memory,
                      hbm_bandwidth=bandwidth, gpus_per_node=ranks,
                      intra_node_bandwidth=link, inter_node_bandwidth=link,
                      matmul_efficiency=1.0, bandwidth_efficiency=1.0, latency=latency,
                      value_bytes=4, kernel_overhead=per_op, action_overhead=per_action,
                      send_overhead=send, receive_overhead=receive)
    if model is None or block is None:
        return cluster
    with computing():
        forward, backward = with_threads(
            threads, lambda: block_overhead(block, cluster, model.hidden))
    return replace(cluster, kernel_overhead=forward, backward_overhead=backward)
