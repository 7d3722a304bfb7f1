"""The frontier schedules for real: 1F1B, ZB-H1, ZB-V and DualPipeV on 2 CPU processes,
next to torch.distributed.pipelining's Schedule1F1B and ScheduleZBVZeroBubble on the same
model, split and micro-batches, in one run.

    python bench/bench_schedules.py            # headline model (minutes; quiet machine)
    python bench/bench_schedules.py --quick    # small model, smoke test

Two ranks with one intra-op thread each (torchrun, gloo). Every runner takes its turn step
by step (`timing.alternate`), so a machine whose speed drifts slows them alike; "vs torch
1F1B" is the median over steps of PyTorch 1F1B's step time over this one's. Single-stage
schedules split the model in 2 stages, two-chunk ones in 4 (each `balance_by_time`).
"predicted" is the simulator fed the run's own mean action times (`simulate_measured`):
the step with no overhead and free messages. The per-kind columns say where the time
goes: our W walks the stage's graph again, so on a CPU I + W can cost more than B.
Prints one JSON object per run, then a table.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from bench_distributed import (Config, batch, build, lm_loss, torchrun_worker, two_splits_main,
                               zero_grad_of)
from pipeline_lib.distributed import DistributedPipe
from pipeline_lib.distributed.job import process_group
from pipeline_lib.distributed.mesh import Mesh, init_mesh
from pipeline_lib.schedules import build as build_schedule, stages_per_rank
from pipeline_lib.timeline import Event, Timeline, rank_facts, simulate_measured
from timing import Runner, alternate, paired_ratio  # bench/timing.py, beside this file

OURS = ["1f1b", "zb_h1", "zb_v", "dualpipe_v"]
TORCH = {"torch 1F1B": "Schedule1F1B", "torch ZBV": "ScheduleZBVZeroBubble"}
BASELINE = "torch 1F1B"


def ours(config: Config, balances: dict[int, list[int]], schedule: str, m: int, mesh: Mesh
         ) -> tuple[Runner, list[list[Event]]]:
    """The runner, and (on rank 0) each measured step's events."""
    balance = balances[stages_per_rank(schedule)]
    pipe = DistributedPipe(build(config), mesh, balance, m, schedule)
    inputs, target = batch(config)
    steps: list[list[Event]] = []

    def record() -> None:
        timeline = pipe.gather_timeline(dst=0)
        if timeline is not None:
            steps.append(timeline.events)

    zero_grad = zero_grad_of(nn.ModuleList(pipe.modules.values()))
    return Runner(lambda: pipe.step(inputs, target, lm_loss), zero_grad, record), steps


def torch_pipelining(config: Config, balances: dict[int, list[int]], kind: str, m: int,
                     rank: int) -> Runner:
    """PyTorch's schedule on the same layers: rank r holds stage r (1F1B), or stages r
    and 3 - r (ZBV's V on 2 ranks)."""
    from torch.distributed import pipelining
    balance = balances[1 if kind == "Schedule1F1B" else 2]
    layers = list(build(config).children())
    bounds = [sum(balance[:s]) for s in range(len(balance) + 1)]
    mine = [rank] if len(balance) == 2 else [rank, len(balance) - 1 - rank]
    modules = [nn.Sequential(*layers[bounds[s]:bounds[s + 1]]) for s in mine]
    stages = [pipelining.PipelineStage(module, s, len(balance), torch.device("cpu"))
              for s, module in zip(mine, modules)]
    cls = getattr(pipelining.schedules, kind)
    schedule = cls(stages[0] if len(stages) == 1 else stages, n_microbatches=m, loss_fn=lm_loss)
    inputs, target = batch(config)
    first, last = 0 in mine, len(balance) - 1 in mine

    def step() -> None:
        if first and last:
            schedule.step(inputs, target=target, losses=[])
        elif first:
            schedule.step(inputs)
        else:
            schedule.step(target=target, losses=[], return_outputs=False)

    return Runner(step, zero_grad_of(nn.ModuleList(modules)))


def worker(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    config = Config(**json.loads(args.config))
    balances = {int(k): v for k, v in json.loads(args.balances).items()}
    results = []
    with process_group(backend="gloo", timeout=600):
        mesh = init_mesh(pp=2)
        for m in args.microbatches:
            runners, recorded = {}, {}
            for name in OURS:
                runners[name], recorded[name] = ours(config, balances, name, m, mesh)
            for name, kind in TORCH.items():
                runners[name] = torch_pipelining(config, balances, kind, m, mesh.rank)
            times = alternate(runners, args.warmup, args.steps, sync=dist.barrier)
            for name, step_times in times.items():
                row = dict(run=name, m=m, step_s=statistics.median(step_times),
                           steps_s=step_times)
                if recorded.get(name):
                    row.update(where_time_goes(name, m, recorded[name]))
                results.append(row)
        if mesh.rank == 0:
            Path(args.out).write_text(json.dumps(results))


def where_time_goes(name: str, m: int, steps: list[list[Event]]) -> dict:
    """Median seconds of one action of each kind, the simulator's step from this run's
    mean action times, and its activation peak."""
    schedule = build_schedule(name, 2, m)
    kinds = {}
    for kind in "FBIW":
        durations = [e.duration for events in steps for e in events if e.action.kind == kind]
        if durations:
            kinds[f"{kind}_s"] = statistics.median(durations)
    predicted = simulate_measured(schedule, Timeline(2, steps[-1], unit="s"))
    return dict(**kinds, predicted_s=predicted.makespan,
                activations=max(f.activations for f in rank_facts(schedule, predicted)))


def launch_ranks(config: Config, balances: dict[int, list[int]],
                 args: argparse.Namespace) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        return torchrun_worker(__file__, config, balances, args, Path(tmp))


def report(config: Config, balances: dict[int, list[int]], runs: list[dict]) -> None:
    baseline = {r["m"]: r["steps_s"] for r in runs if r["run"] == BASELINE}
    for r in runs:
        r["vs_torch_1f1b"] = paired_ratio(baseline[r["m"]], r["steps_s"])
        print(json.dumps({**r, "balances": balances, "config": asdict(config)}))
    print(f"\n{config}; 2 stages {balances[1]}, 4 stages {balances[2]}; 2 ranks x 1 thread")
    print("| run | m | step (s) | vs torch 1F1B | predicted (s) | activations "
          "| F (ms) | B (ms) | I (ms) | W (ms) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in runs:
        cells = [f"{1e3 * r[k]:.1f}" if k in r else "" for k in ("F_s", "B_s", "I_s", "W_s")]
        predicted = f"{r['predicted_s']:.3f}" if "predicted_s" in r else ""
        memory = f"{r['activations']:g}" if "activations" in r else ""
        print(f"| {r['run']} | {r['m']} | {r['step_s']:.3f} | {r['vs_torch_1f1b']:.2f}x | "
              f"{predicted} | {memory} | " + " | ".join(cells) + " |")
    print("F, B, I, W: median time of one action (two-chunk schedules: of half a rank's "
          "layers); activations: the simulator's peak, in micro-batches of a rank's layers "
          "(1F1B's is 2 on 2 ranks).")


def main() -> None:
    two_splits_main(__doc__, worker, launch_ranks, report)


if __name__ == "__main__":
    main()
