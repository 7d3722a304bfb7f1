"""What one kind of work costs on this machine, measured: the rates and fixed costs a
`Cluster` for it holds (`plan.local.measure_local_cluster` puts them together).

* what one dispatched operation costs however small (eager dispatch, autograd, the
  modules' Python): on the model's own block at one token, forward and backward apart
  (`block_overhead`), or on a chain of tiny multiplies (`kernel_overhead`); and what the
  executors' stage runner adds to each action (`action_overhead`);
* what one more token costs (`marginal_rate`): the FLOP/s of the model's own matrix
  multiplies as autograd runs them (`model_matmul_flops`), and the bytes/s of its other
  kernels, on its block (`model_memory_bandwidth`); or one large multiply and one large
  copy.
"""
from __future__ import annotations

import contextlib
import copy
import statistics
import threading
import time
from dataclasses import replace
from typing import Callable, Iterator, TypeVar

import torch
from torch import nn

from pipeline_lib.plan.hardware import Cluster
from pipeline_lib.plan.kernels import counted
from pipeline_lib.plan.model import Model, Work
from pipeline_lib.rng import owned_rng
from pipeline_lib.stage import StageRunner

T = TypeVar("T")


def median_seconds(run: Callable[[], object], repeats: int) -> float:
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


def with_threads(threads: int, measure: Callable[[], T]) -> T:
    """``measure()`` with ``threads`` intra-op threads, as the rank it prices runs."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return measure()
    finally:
        torch.set_num_threads(before)


def matmul_flops(size: int = 1024, threads: int = 1, repeats: int = 7) -> float:
    """FLOP/s of one ``size``² × ``size``² float32 matrix multiply on ``threads`` threads."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    return 2 * size ** 3 / with_threads(threads, lambda: median_seconds(lambda: a @ b, repeats))


def memory_bandwidth(nbytes: int = 256 * 2 ** 20, threads: int = 1, repeats: int = 7) -> float:
    """Bytes/s of one large copy (each byte read once and written once)."""
    source = torch.ones(nbytes // 4)
    target = torch.empty_like(source)
    return 2 * nbytes / with_threads(
        threads, lambda: median_seconds(lambda: target.copy_(source), repeats))


def kernel_overhead(chain: int = 200, threads: int = 1, repeats: int = 7) -> float:
    """Seconds per dispatched operation of a chain of tiny multiplies, forward and
    backward, each operation counted (`counted`): what an operation costs however
    small, eager dispatch and autograd bookkeeping included."""
    x = torch.ones(1, requires_grad=True)

    def run() -> None:
        y = x
        for _ in range(chain):
            y = y * 1.0001
        y.sum().backward()
    return with_threads(threads, lambda: median_seconds(run, repeats)) / counted(run).ops


def _pass_times(forward: Callable[[], torch.Tensor], repeats: int
                ) -> tuple[float, float, Work, Work]:
    """Median seconds of ``forward`` and of the backward of its output, and their
    counted `Work`, each timed apart (after one run to warm up)."""
    times: tuple[list[float], list[float]] = ([], [])
    for k in range(repeats + 1):
        start = time.perf_counter()
        out = forward()
        middle = time.perf_counter()
        out.backward(torch.ones_like(out))
        if k:
            times[0].append(middle - start)
            times[1].append(time.perf_counter() - middle)
    holder: list[torch.Tensor] = []
    work = counted(lambda: holder.append(forward()))
    return (statistics.median(times[0]), statistics.median(times[1]), work,
            counted(lambda: holder[0].backward(torch.ones_like(holder[0]))))


def block_overhead(block: nn.Module, cluster: Cluster, hidden: int,
                   repeats: int = 200) -> tuple[float, float]:
    """Seconds per dispatched operation of a model's own ``block`` at one token, of its
    forward and of its backward: each pass's measured time, less what ``cluster``'s
    rates price its FLOPs and bytes at (`Cluster.work_seconds`; at one token mostly its
    weights' traffic), over the operations it dispatches. Unlike a chain of bare
    operations this includes what the block's modules do in Python around each one of
    the forward (argument checks, module calls), which a small model pays on every
    operation; the backward's, which autograd's engine runs from C++, cost less. A run
    takes about a millisecond: ``repeats`` is large, for a stable median."""
    x = torch.randn(1, 1, hidden, requires_grad=True)
    forward, backward, *works = _pass_times(lambda: block(x), repeats)
    rates = replace(cluster, kernel_overhead=0.0)
    return tuple(max(seconds - rates.work_seconds(work), 0.0) / max(work.ops, 1)
                 for seconds, work in zip((forward, backward), works))


class _Scale(nn.Module):
    """One multiply: a stage whose kernels cost next to nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


def action_overhead(repeats: int = 400) -> float:
    """Seconds the executors' `StageRunner` adds to each action (forward or backward)
    of a middle stage: a stage of one multiply run through it, less the same stage run
    plainly, per action. Its Python: cutting the graph at the stage boundary, the
    micro-batch's random stream, the bookkeeping of what each backward needs."""
    stage, x, grad = _Scale(), torch.ones(1), torch.ones(1)
    plain_f, plain_b, *_ = _pass_times(lambda: stage(x.detach().requires_grad_()), repeats)
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(repeats // 10 + 1):
        runner = StageRunner(1, stage, torch.device("cpu"), "never", 10, 0, rng=owned_rng)
        for i in range(10):
            start = time.perf_counter()
            runner.forward(i, x)
            middle = time.perf_counter()
            runner.backward(i, grad)
            times[0].append(middle - start)
            times[1].append(time.perf_counter() - middle)
    runner_f, runner_b = (statistics.median(t[10:]) for t in times)
    return max((runner_f - plain_f + runner_b - plain_b) / 2, 0.0)


def marginal_rate(kernels: Callable[[int], Callable[[], None]],
                  work: Callable[[Work], float], tokens: int, budget: float = 2.0,
                  priced: Callable[[Work], float] = lambda work: 0.0) -> float:
    """What one more token's work (``work`` of the counted `Work`: its FLOPs, or its
    bytes) gets done per second: between one token and ``tokens`` (``kernels(n)`` builds
    the run at n tokens), the work added over the median time added, less the seconds
    of the added work that are ``priced`` already (the multiplies, at their measured
    rate, when the bytes' rate is measured on a whole block). What an operation costs
    however small cancels out (it is priced apart, per dispatched operation), and so
    does what a multiply streams whatever its size (its weights); the two sizes take
    turns, so that a drift of the machine slows both alike. Repeated for about
    ``budget`` seconds (10 to 400 times each)."""
    tokens = max(tokens, 2)
    small, large = kernels(1), kernels(tokens)
    large_work, small_work = counted(large), counted(small)   # also warms both up
    added = work(large_work) - work(small_work)
    known = priced(large_work) - priced(small_work)
    start = time.perf_counter()
    large()
    repeats = int(min(400, max(10, budget / 2 / max(time.perf_counter() - start, 1e-6))))
    times: dict[Callable[[], None], list[float]] = {small: [], large: []}
    for _ in range(repeats):
        for run in (small, large):
            start = time.perf_counter()
            run()
            times[run].append(time.perf_counter() - start)
    extra = statistics.median(times[large]) - statistics.median(times[small]) - known
    return added / max(extra, 1e-9)


def model_matmul_flops(model: Model, micro_batch: int, threads: int = 1) -> float:
    """FLOP/s of ``model``'s own matrix multiplies at ``micro_batch`` sequences, as
    autograd runs them: a block's query-key-value, output and MLP projections and the
    vocabulary projection, forward, input gradient and weight gradient (``F.linear`` and
    its backward: the transposed layouts, the bias, fresh outputs), per `marginal_rate`.
    A small model's multiplies reach far less than a large square one's, so this, not
    `matmul_flops`, is the peak its step sees."""
    h, f = model.hidden, model.ffn
    shapes = [(h, model.qkv_width), (h, h), (h, (model.mlp_matrices - 1) * f), (f, h),
              (h, model.vocab)]

    def kernels(tokens: int) -> Callable[[], None]:
        layers = [(torch.randn(tokens, k, requires_grad=True),
                   torch.randn(n, k, requires_grad=True), torch.randn(n, requires_grad=True),
                   torch.randn(tokens, n)) for k, n in shapes]

        def run() -> None:
            for x, weight, bias, grad in layers:
                nn.functional.linear(x, weight, bias).backward(grad)
        return run
    return with_threads(threads, lambda: marginal_rate(kernels, lambda work: work.flops,
                                                       micro_batch * model.seq_len))


def model_memory_bandwidth(model: Model, micro_batch: int, block: nn.Module,
                           peak_flops: float, threads: int = 1) -> float:
    """Bytes/s of ``model``'s own kernels other than its matrix multiplies, on its own
    ``block`` (forward and backward), per `marginal_rate`: the bytes that its kernels
    read and write (counted as `count_kernels` counts them) over the time that a
    micro-batch of ``micro_batch`` sequences adds to one token, less its multiplies' at
    ``peak_flops``. On one CPU core the norms, softmax, dropout's random masks, copies
    and the gradients' sums are bound by its arithmetic and its caches more than by
    DRAM, each kind at its own rate: a large copy's bandwidth is not what they see, and
    the mix that sets their rate is the block's."""
    def kernels(tokens: int) -> Callable[[], None]:
        shape = (1, 1, model.hidden) if tokens == 1 else \
            (micro_batch, model.seq_len, model.hidden)
        return block_work(block, shape)
    return with_threads(threads, lambda: marginal_rate(
        kernels, lambda work: work.gemm_bytes + work.nbytes, micro_batch * model.seq_len,
        priced=lambda work: work.flops / peak_flops))


def block_work(block: nn.Module, shape: tuple[int, ...]) -> Callable[[], None]:
    """The forward and backward of ``block`` on one micro-batch of ``shape``."""
    x = torch.randn(*shape, requires_grad=True)
    return lambda: block(x).sum().backward()


@contextlib.contextmanager
def busy_peer(block: nn.Module, shape: tuple[int, ...]) -> Iterator[None]:
    """A thread that runs a copy of ``block`` forward and backward on micro-batches of
    ``shape`` while the block runs: measurements taken inside see this process as the
    threaded `Pipe`'s stages do, the other stage's thread computing too, the two taking
    turns holding the GIL for their Python."""
    work, stop = block_work(copy.deepcopy(block), shape), threading.Event()

    def peer() -> None:
        while not stop.is_set():
            work()
    thread = threading.Thread(target=peer, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
