"""Our schedules in PyTorch's runtime against PyTorch's own builders of the same schedules,
on 2 CPU processes, in one run.

    python bench/bench_pytorch_runtime.py            # headline model (minutes; quiet machine)
    python bench/bench_pytorch_runtime.py --quick    # small model, smoke test

For each schedule PyTorch builds (GPipe, 1F1B, interleaved 1F1B, looped BFS, interleaved
zero bubble, ZB-V, DualPipeV): PyTorch's class (``ScheduleGPipe``, ...) and our builder's
schedule of the same name, exported with `Schedule.to_csv` and run by
``_PipelineScheduleRuntime`` (`pipeline_lib.pytorch.runner`), twice: ``compute_only``
(PyTorch lowers it) and ``compute_comms`` (our lowering's messages). Every runner of a rank
computes on the same layers (one model per rank, cut by `group_layers` with
`balance_by_time`'s balance for 2 or 4 stages), the same batch and micro-batches; they take
turns step by step (`timing.alternate`), and "vs PyTorch's" is the median over steps of
PyTorch's step time over ours (above 1: ours faster). Two ranks with one intra-op thread
each (torchrun, gloo). Prints one JSON object per run, then a table.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import pipelining

from bench_distributed import Config, batch, build, lm_loss, torchrun_worker, two_splits_main
from pipeline_lib.course.pytorch_schedules import PYTORCH_NAMES
from pipeline_lib.distributed.job import process_group
from pipeline_lib.pytorch.runner import exported, run_step, runtime_for, stages_for
from pipeline_lib.schedules import build as build_schedule, stages_per_rank
from timing import Runner, alternate, paired_ratio  # bench/timing.py, beside this file

FORMATS = ("compute_only", "compute_comms")
THEIRS = "PyTorch's"
TARGET = 0.97          # ours at least this fast as PyTorch's builder: within 3%


def stepper(schedule: Any, stages: list[Any], m: int, inputs: torch.Tensor,
            target: torch.Tensor) -> Runner:
    """One training step of ``schedule`` (ours or PyTorch's, the same call either way), and
    the zeroing of the gradients of the layers its ``stages`` hold."""
    layers = nn.ModuleList(s.submod for s in stages)
    return Runner(lambda: run_step(schedule, stages, m, inputs, target),
                  lambda: layers.zero_grad(set_to_none=True))


def runners(config: Config, balances: dict[int, list[int]], m: int, folder: Path,
            rank: int) -> dict[str, Runner]:
    """Per schedule, PyTorch's builder and ours in both formats, all on one model's layers."""
    model = build(config)
    inputs, target = batch(config)
    device = torch.device("cpu")
    made = {}
    for ours, theirs in PYTORCH_NAMES.items():
        schedule = build_schedule(ours, 2, m)
        balance = balances[stages_per_rank(ours)]
        stages = stages_for(model, balance, schedule, rank, device)
        cls = getattr(pipelining, f"Schedule{theirs}")
        runtime = cls(stages if len(stages) > 1 else stages[0], n_microbatches=m,
                      loss_fn=lm_loss)
        made[f"{ours} | {THEIRS}"] = stepper(runtime, stages, m, inputs, target)
        for fmt in FORMATS:
            csv = exported(folder / f"{ours}-{fmt}.csv")
            stages = stages_for(model, balance, csv.schedule, rank, device)
            made[f"{ours} | {fmt}"] = stepper(runtime_for(stages, csv, lm_loss), stages, m,
                                              inputs, target)
    return made


def worker(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    config = Config(**json.loads(args.config))
    balances = {int(k): v for k, v in json.loads(args.balances).items()}
    results = []
    with process_group(backend="gloo", timeout=900):
        rank = dist.get_rank()
        for m in args.microbatches:
            made = runners(config, balances, m, Path(args.out).parent / f"m{m}", rank)
            times = alternate(made, args.warmup, args.steps, sync=dist.barrier)
            for name, step_times in times.items():
                schedule, source = name.split(" | ")
                results.append(dict(schedule=schedule, source=source, m=m,
                                    step_s=statistics.median(step_times), steps_s=step_times))
        if rank == 0:
            Path(args.out).write_text(json.dumps(results))


def launch_ranks(config: Config, balances: dict[int, list[int]],
                 args: argparse.Namespace) -> list[dict]:
    """Write every schedule's CSVs, then run the worker on 2 processes."""
    with tempfile.TemporaryDirectory() as tmp:
        for m in args.microbatches:
            (Path(tmp) / f"m{m}").mkdir()
            for ours in PYTORCH_NAMES:
                for fmt in FORMATS:
                    build_schedule(ours, 2, m).to_csv(Path(tmp) / f"m{m}" / f"{ours}-{fmt}.csv",
                                                      format=fmt)
        return torchrun_worker(__file__, config, balances, args, Path(tmp))


def report(config: Config, balances: dict[int, list[int]], runs: list[dict]) -> None:
    theirs = {(r["schedule"], r["m"]): r["steps_s"] for r in runs if r["source"] == THEIRS}
    for r in runs:
        r["vs_pytorch"] = paired_ratio(theirs[r["schedule"], r["m"]], r["steps_s"])
        print(json.dumps({**r, "balances": balances, "config": asdict(config)}))
    print(f"\n{config}; 2 stages {balances[1]}, 4 stages {balances[2]}; 2 ranks x 1 thread")
    print("| schedule | m | PyTorch's builder (s) | ours, compute_only (s) | vs PyTorch's "
          "| ours, compute_comms (s) | vs PyTorch's |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    by = {(r["schedule"], r["m"], r["source"]): r for r in runs}
    for schedule, m in sorted({(r["schedule"], r["m"]) for r in runs},
                              key=lambda k: (k[1], list(PYTORCH_NAMES).index(k[0]))):
        cells = [f"{by[schedule, m, THEIRS]['step_s']:.3f}"]
        for fmt in FORMATS:
            r = by[schedule, m, fmt]
            mark = "" if r["vs_pytorch"] >= TARGET else " (below 0.97)"
            cells += [f"{r['step_s']:.3f}", f"{r['vs_pytorch']:.3f}x{mark}"]
        print(f"| {schedule} ({PYTORCH_NAMES[schedule]}) | {m} | " + " | ".join(cells) + " |")
    print("vs PyTorch's: median over steps of PyTorch's step time over ours, taking turns; "
          "the target is 0.97 or more (within 3%).")


def main() -> None:
    two_splits_main(__doc__, worker, launch_ranks, report)


if __name__ == "__main__":
    main()
