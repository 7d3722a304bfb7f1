"""Threaded Pipe against the same work on one thread, side by side, on the CPU.

Two stages, each on its own thread with one intra-op thread. Three runs take turns step by
step (bench/timing.py): ``sequential``, the whole batch on one thread; ``accumulated``, the
same m micro-batches one after another on one thread (the pipeline's work without the
pipeline); and ``Pipe.step``. From their per-turn ratios:

* pipeline speedup = accumulated / Pipe step; efficiency = that over the ideal p·m/(m+p−1);
* micro-batching = sequential / accumulated: what smaller kernels cost (below 1) before any
  pipelining;
* net speedup = sequential / Pipe step, which is micro-batching × pipeline speedup.

    python bench/bench_pipe.py --efficiency    # issue 15's table (3-5 minutes): both models,
                                               # m = 4 and 8, Pipe's default allocator
                                               # setting against glibc's defaults
    python bench/bench_pipe.py                 # the Transformer, m = 1, 2, 4, 8, GPipe and
                                               # 1F1B, 3 turns (several minutes)
    python bench/bench_pipe.py --model mlp --microbatches 4 8 --repeats 10
    python bench/bench_pipe.py --quick         # smoke test

Each run prints one JSON line per configuration, then a table. The allocator setting is
process-wide and cannot be undone, so ``--efficiency`` runs each (model, allocator) in a
process of its own.
"""
from __future__ import annotations

import argparse
import copy
import json
import platform
import resource
import statistics
import subprocess
import sys
from typing import Callable

import torch
from torch import nn

from pipeline_lib import Pipe
from pipeline_lib.threaded import allocator
from timing import Runner, alternate, paired_ratio  # bench/timing.py, beside this file

P = 2                  # stages, one thread each
TARGET = 0.85          # issue 15: efficiency at m = 4 and 8, with Pipe's default path
MODELS = ("transformer", "mlp")


def build(name: str, quick: bool) -> tuple[nn.Sequential, torch.Tensor, torch.Tensor, str]:
    """8 equal blocks (so [4, 4] is the balanced split), an input batch and a target.

    ``transformer``: the benchmark model, 4096 tokens a batch. ``mlp``: a plain stack of
    feed-forward blocks, the notebook 01 kind of model, whose micro-batches are small
    (32 rows at m = 8), so micro-batching costs more than in the Transformer."""
    torch.manual_seed(0)
    if name == "transformer":
        d, ff, heads, batch, seq = (64, 128, 4, 16, 16) if quick else (512, 2048, 8, 64, 64)
        model = nn.Sequential(*[nn.TransformerEncoderLayer(d, heads, ff, dropout=0.1,
                                                           batch_first=True)
                                for _ in range(8)])
        shape = (batch, seq, d)
        about = f"8x TransformerEncoderLayer d={d} h={heads} ff={ff}, batch {batch}x{seq} tokens"
    else:
        d, ff, batch = (64, 256, 32) if quick else (512, 2048, 256)
        model = nn.Sequential(*[nn.Sequential(nn.Linear(d, ff), nn.ReLU(), nn.Linear(ff, d))
                                for _ in range(8)])
        shape = (batch, d)
        about = f"8x MLP block {d}-{ff}-{d}, batch {batch}"
    return model, torch.randn(*shape), torch.randn(*shape), about


def counting_faults(step: Callable[[], object], faults: list[int]) -> Callable[[], object]:
    """``step``, appending the minor page faults the whole process took during it."""
    def counted() -> object:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        result = step()
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
        return result
    return counted


def measure(name: str, microbatches: list[int], schedules: list[str], repeats: int,
            keep_freed_memory: bool, quick: bool) -> tuple[dict, list[dict]]:
    """One process's measurement: every run in one `alternate`, so they share turns."""
    torch.set_num_threads(1)   # one intra-op thread per stage thread
    model, x, target, about = build(name, quick)
    loss_fn = nn.MSELoss()
    balance = [len(model) // P] * P
    pipes = {(schedule, m): Pipe(copy.deepcopy(model), chunks=m, checkpoint="never",
                                 balance=balance, keep_freed_memory=keep_freed_memory)
             for schedule in schedules for m in microbatches}

    def zero_grad() -> None:
        model.zero_grad(set_to_none=True)

    def accumulate(m: int) -> None:
        """The pipeline's work on one thread: the same micro-batches, one after another."""
        for xi, ti in zip(x.chunk(m), target.chunk(m)):
            (loss_fn(model(xi), ti) * len(xi) / len(x)).backward()

    faults: dict[str, list[int]] = {}

    def runner(key: str, step: Callable[[], object], zero: Callable[[], None]) -> Runner:
        return Runner(counting_faults(step, faults.setdefault(key, [])), zero)

    runners = {"sequential": runner("sequential",
                                    lambda: loss_fn(model(x), target).backward(), zero_grad)}
    for m in microbatches:
        if m > 1:   # at m = 1 the accumulated run is the sequential one
            runners[f"accumulated m={m}"] = runner(f"accumulated m={m}",
                                                   lambda m=m: accumulate(m), zero_grad)
    for (schedule, m), pipe in pipes.items():
        runners[f"{schedule} m={m}"] = runner(
            f"{schedule} m={m}", lambda pipe=pipe, s=schedule: pipe.step(x, target, loss_fn, s),
            lambda pipe=pipe: pipe.zero_grad(set_to_none=True))
    warmup = 1
    times = alternate(runners, warmup, repeats)

    def faults_per_step(key: str) -> int:
        return round(statistics.median(faults[key][warmup:]))

    rows = []
    for (schedule, m), pipe in pipes.items():
        accumulated = "sequential" if m == 1 else f"accumulated m={m}"
        seq, acc, piped = times["sequential"], times[accumulated], times[f"{schedule} m={m}"]
        ideal = P * m / (m + P - 1)
        speedup = paired_ratio(acc, piped)
        rows.append({
            "model": name, "allocator": "kept" if allocator.in_force() else "glibc defaults",
            "schedule": schedule, "m": m, "ideal": ideal,
            "pipeline_speedup": speedup, "efficiency": speedup / ideal,
            "micro_batching": paired_ratio(seq, acc), "net_speedup": paired_ratio(seq, piped),
            "step_s": statistics.median(piped), "accumulated_step_s": statistics.median(acc),
            "sequential_step_s": statistics.median(seq),
            "faults_per_step": {"pipe": faults_per_step(f"{schedule} m={m}"),
                                "accumulated": faults_per_step(accumulated),
                                "sequential": faults_per_step("sequential")},
            "bubble_measured": pipe.timeline.bubble_fraction()})
    meta = {"model": name, "about": about, "machine": platform.processor() or
            platform.machine(), "torch": torch.__version__, "threads_per_stage": 1,
            "balance": balance, "turns": repeats, "warmup_turns": warmup,
            "allocator": "kept" if allocator.in_force() else "glibc defaults"}
    return meta, rows


def print_table(rows: list[dict]) -> None:
    print("| model | allocator | schedule | m | ideal | pipeline speedup | efficiency "
          f"(target ≥ {TARGET:.0%}) | micro-batching | net speedup | Pipe step (s) "
          "| accumulated (s) | sequential (s) | faults/step Pipe, accumulated | bubble |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        verdict = "met" if r["efficiency"] >= TARGET else "missed"
        faults = r["faults_per_step"]
        print(f"| {r['model']} | {r['allocator']} | {r['schedule']} | {r['m']} "
              f"| {r['ideal']:.2f} | {r['pipeline_speedup']:.2f} "
              f"| {r['efficiency']:.0%} ({verdict}) | {r['micro_batching']:.2f} "
              f"| {r['net_speedup']:.2f} | {r['step_s']:.3f} | {r['accumulated_step_s']:.3f} "
              f"| {r['sequential_step_s']:.3f} | {faults['pipe']}, {faults['accumulated']} "
              f"| {r['bubble_measured']:.2f} |")


def efficiency(args: argparse.Namespace) -> None:
    """Every (model, allocator) in a process of its own; their JSON lines, then one table."""
    rows = []
    for name in MODELS:
        repeats = args.repeats or (2 if name == "transformer" else 6)
        for keep in (True, False):
            command = [sys.executable, __file__, "--json", "--model", name, "--repeats",
                       str(repeats), "--microbatches", "4", "8", "--schedules",
                       *args.schedules] + (["--quick"] if args.quick else []) + \
                      ([] if keep else ["--system-malloc"])
            run = subprocess.run(command, capture_output=True, text=True)
            if run.returncode:
                sys.exit(f"{' '.join(command)} failed:\n{run.stderr}")
            for line in run.stdout.splitlines():
                print(line, flush=True)
                record = json.loads(line)
                if "meta" not in record:
                    rows.append(record)
    print(f"\nTimings: medians over turns; every ratio is the median of per-turn ratios "
          f"within one process. p = {P} stage threads x 1 intra-op thread. Ideal = "
          f"p·m/(m+p−1). Pipeline speedup = accumulated / Pipe step; efficiency = pipeline "
          f"speedup / ideal; micro-batching = sequential / accumulated; net speedup = "
          f"sequential / Pipe step. Allocator 'kept': Pipe's default (glibc keeps freed "
          f"memory, pipeline_lib.threaded.allocator); 'glibc defaults': "
          f"Pipe(..., keep_freed_memory=False).")
    print_table(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--efficiency", action="store_true",
                        help="issue 15's table: both models, m = 4 and 8, both allocators")
    parser.add_argument("--model", choices=MODELS, default="transformer")
    parser.add_argument("--quick", action="store_true", help="tiny models, one turn")
    parser.add_argument("--repeats", type=int, help="measured turns (default: 3; with "
                        "--efficiency 2 for the Transformer, 6 for the MLP)")
    parser.add_argument("--microbatches", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--schedules", nargs="+", default=None,
                        help="default: gpipe 1f1b; with --efficiency: gpipe")
    parser.add_argument("--system-malloc", action="store_true",
                        help="Pipe(..., keep_freed_memory=False): leave glibc's defaults, "
                             "which fault every step's activations in again")
    parser.add_argument("--json", action="store_true", help="JSON lines only, no table")
    args = parser.parse_args()
    if args.quick:
        args.repeats = 1
    if args.efficiency:
        args.schedules = args.schedules or ["gpipe"]
        efficiency(args)
        return
    meta, rows = measure(args.model, args.microbatches, args.schedules or ["gpipe", "1f1b"],
                         args.repeats or 3, not args.system_malloc, args.quick)
    print(json.dumps({"meta": meta}))
    for row in rows:
        print(json.dumps(row))
    if not args.json:
        print(f"\n{meta['about']}, balance {meta['balance']}; timings are medians over "
              f"{meta['turns']} turns, ratios medians of per-turn ratios (see the docstring).")
        print_table(rows)


if __name__ == "__main__":
    main()
