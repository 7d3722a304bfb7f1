"""Threaded Pipe vs plain sequential training, side by side, on the CPU.

Two stages, each on its own thread with one intra-op thread, against the same model
trained without a pipeline on one thread. Prints one JSON line per configuration, then a
table of speedups next to the ideal of a fill-drain pipeline.

    python bench/bench_pipe.py                       # the README's table (~15 minutes)
    python bench/bench_pipe.py --batch 32 --microbatches 8 --repeats 10
                                                     # micro-batches half as big
    python bench/bench_pipe.py --quick               # smoke test

Each configuration also times the same micro-batches one after another on one thread:
what smaller kernels cost before any pipelining.
"""
from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics

import torch
from torch import nn

from pipeline_lib import Pipe
from pipeline_lib.partition import balance_by_time
from timing import Runner, alternate, keep_freed_memory, paired_ratio  # bench/timing.py, beside this file


def transformer_stack(d_model: int, layers: int, heads: int, ff: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.TransformerEncoderLayer(d_model, heads, ff, dropout=0.1,
                                                      batch_first=True)
                           for _ in range(layers)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, one repeat")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--microbatches", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--batch", type=int, default=64, help="sequences per mini-batch")
    parser.add_argument("--system-malloc", action="store_true",
                        help="leave glibc's defaults, which fault every step's activations "
                             "in again (see timing.keep_freed_memory)")
    args = parser.parse_args()
    allocator = "glibc defaults" if args.system_malloc else (
        "glibc, freed memory kept" if keep_freed_memory() else "system")

    torch.set_num_threads(1)  # one intra-op thread per stage thread
    if args.quick:
        d_model, layers, heads, ff, batch, seq, repeats = 64, 4, 4, 128, 16, 16, 1
    else:
        d_model, layers, heads, ff, batch, seq = 512, 8, 8, 2048, args.batch, 64
        repeats = args.repeats
    model = transformer_stack(d_model, layers, heads, ff)
    x = torch.randn(batch, seq, d_model)
    target = torch.randn(batch, seq, d_model)
    loss_fn = nn.MSELoss()
    p = 2
    balance = balance_by_time(model, x[: batch // max(args.microbatches)], p)

    def zero_grad() -> None:
        model.zero_grad(set_to_none=True)

    def accumulate(m: int) -> None:
        """The pipeline's work on one thread: the same micro-batches, one after another."""
        for xi, ti in zip(x.chunk(m), target.chunk(m)):
            (loss_fn(model(xi), ti) * len(xi) / len(x)).backward()

    sequential = Runner(lambda: loss_fn(model(x), target).backward(), zero_grad)
    rows = []
    for schedule in ("gpipe", "1f1b"):
        for m in args.microbatches:
            pipe = Pipe(copy.deepcopy(model), chunks=m, checkpoint="never", balance=balance)
            piped = Runner(lambda: pipe.step(x, target, loss_fn, schedule),
                           lambda: pipe.zero_grad(set_to_none=True))
            accumulated = Runner(lambda: accumulate(m), zero_grad)
            times = alternate({"sequential": sequential, "pipe": piped,
                               "accumulated": accumulated}, 1, repeats)
            rows.append({"schedule": schedule, "m": m,
                         "step_s": statistics.median(times["pipe"]),
                         "sequential_step_s": statistics.median(times["sequential"]),
                         "speedup": paired_ratio(times["sequential"], times["pipe"]),
                         "micro_batching": paired_ratio(times["sequential"],
                                                        times["accumulated"]),
                         "ideal": p * m / (m + p - 1),
                         "bubble_measured": pipe.timeline.bubble_fraction()})
            rows[-1]["of_ideal"] = rows[-1]["speedup"] / rows[-1]["ideal"]

    meta = {"machine": platform.processor() or platform.machine(), "torch": torch.__version__,
            "threads_per_stage": 1, "allocator": allocator,
            "model": f"{layers}x TransformerEncoderLayer d={d_model} h={heads} ff={ff}",
            "batch": batch, "seq": seq, "balance": balance}
    print(json.dumps({"meta": meta}))
    for row in rows:
        print(json.dumps(row))

    print(f"\nSequential (1 thread) vs Pipe.step (2 stage threads x 1 thread), balance "
          f"{balance}, allocator: {allocator}. Speedup = median over turns of sequential / "
          f"Pipe step time, the runs taking turns. Ideal = p·m/(m+p-1) for p = {p} equal "
          f"stages. Micro-batching = sequential / the same m micro-batches one after "
          f"another on one thread: what smaller kernels cost before any pipelining.")
    print("| schedule | m | Pipe step (s) | sequential step (s) | speedup | ideal | of ideal "
          "| micro-batching | bubble |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['schedule']} | {r['m']} | {r['step_s']:.3f} | {r['sequential_step_s']:.3f} "
              f"| {r['speedup']:.2f} | {r['ideal']:.2f} | {r['of_ideal']:.0%} | "
              f"{r['micro_batching']:.2f} | {r['bubble_measured']:.2f} |")


if __name__ == "__main__":
    main()
