"""Multi-process pipeline throughput on CPU: pipeline_lib.distributed next to
torch.distributed.pipelining and plain sequential training, same model, data and weights.

    python bench/bench_distributed.py            # headline model (minutes; quiet machine)
    python bench/bench_distributed.py --quick    # small model, smoke test

Two ranks with one intra-op thread each (torchrun, gloo), against one process with one and
with two threads. "pipeline_lib plain" is the same pipeline on the transport's first layer
only (`p2p.PointToPoint`: header, then tensors, each waiting for its receive); "pipeline_lib"
adds its second (`p2p.PostedEarly`: layouts agreed once, receives posted before they are needed). One step is
the forward and backward of the global batch, between barriers. For each micro-batch
count m, t_s is the measured forward + backward time of one micro-batch on stage s (from
pipeline_lib's own timelines), and the ideal fill-drain step takes Σt_s + (m-1)·max t_s;
"of ideal" is that over the measured step time.
Prints one JSON object per run, then a table.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from pipeline_lib.distributed import DistributedPipe
from pipeline_lib.distributed.job import process_group
from pipeline_lib.distributed.mesh import Mesh, init_mesh
from pipeline_lib.lm.model import transformer_lm
from pipeline_lib.partition import balance_by_time
from timing import Runner, alternate, paired_ratio  # bench/timing.py, beside this file


@dataclass(frozen=True)
class Config:
    vocab: int
    d_model: int
    layers: int
    heads: int
    ff: int
    seq: int
    batch: int


HEADLINE = Config(vocab=10000, d_model=512, layers=8, heads=8, ff=2048, seq=64, batch=32)
QUICK = Config(vocab=1000, d_model=64, layers=4, heads=4, ff=128, seq=16, batch=16)
SCHEDULES = {"gpipe": "GPipe", "1f1b": "1F1B"}


def build(config: Config) -> nn.Sequential:
    torch.manual_seed(0)
    return transformer_lm(config.vocab, d_model=config.d_model, nhead=config.heads,
                          d_hid=config.ff, nlayers=config.layers, dropout=0.0)


def batch(config: Config) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, config.vocab, (config.batch, config.seq + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


# -- one process ---------------------------------------------------------------------

def sequential(config: Config, threads: int, warmup: int, steps: int) -> float:
    """Median seconds per forward + backward of the whole batch in one process."""
    torch.set_num_threads(threads)
    model, (inputs, target) = build(config), batch(config)
    times = []
    for _ in range(warmup + steps):
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        lm_loss(model(inputs), target).backward()
        times.append(time.perf_counter() - start)
    return statistics.median(times[warmup:])


# -- two ranks (torchrun runs this file with --worker) ----------------------------------

def zero_grad_of(module: nn.Module) -> Callable[[], None]:
    return lambda: module.zero_grad(set_to_none=True)


def ours(config: Config, balance: list[int], schedule: str, m: int, mesh: Mesh,
         post_early: bool = True) -> tuple[Runner, dict[tuple[int, str], list[float]]]:
    """The runner, and the durations of every action on each (stage, kind) that rank 1
    gathers from the timelines of the measured steps."""
    pipe = DistributedPipe(build(config), mesh, balance, m, schedule, post_early=post_early)
    inputs, target = batch(config)
    durations: dict[tuple[int, str], list[float]] = {}

    def record() -> None:
        timeline = pipe.gather_timeline(dst=1)
        for e in timeline.events if timeline is not None else []:
            durations.setdefault((e.action.stage, e.action.kind), []).append(e.duration)

    zero_grad = zero_grad_of(nn.ModuleList(pipe.modules.values()))
    return Runner(lambda: pipe.step(inputs, target, lm_loss), zero_grad, record), durations


def torch_pipelining(config: Config, balance: list[int], schedule: str, m: int,
                     rank: int) -> Runner:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
    layers = list(build(config).children())
    start = sum(balance[:rank])
    module = nn.Sequential(*layers[start:start + balance[rank]])
    stage = PipelineStage(module, rank, 2, torch.device("cpu"))
    kind = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
    runner = kind(stage, n_microbatches=m, loss_fn=lm_loss)
    inputs, target = batch(config)

    def step() -> None:
        if rank == 0:
            runner.step(inputs)
        else:
            runner.step(target=target, losses=[], return_outputs=False)

    return Runner(step, zero_grad_of(module))


def worker(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    config = Config(**json.loads(args.config))
    balance = [int(b) for b in args.balance.split(",")]
    results = []
    with process_group(backend="gloo", timeout=600):
        mesh = init_mesh(pp=2)
        for m in args.microbatches:
            for schedule in SCHEDULES:
                our_runner, durations = ours(config, balance, schedule, m, mesh)
                runners = {"pipeline_lib": our_runner}
                if not args.ours_only:
                    runners["pipeline_lib plain"] = ours(config, balance, schedule, m, mesh,
                                                         post_early=False)[0]
                    runners["torch.pipelining"] = torch_pipelining(config, balance, schedule,
                                                                   m, mesh.rank)
                times = alternate(runners, args.warmup, args.steps, sync=dist.barrier)
                stage_s = [statistics.median(durations[(s, "F")])
                           + statistics.median(durations[(s, "B")])
                           for s in range(len(balance))] if durations else None
                for impl, impl_times in times.items():
                    results.append(dict(impl=impl, schedule=schedule, m=m,
                                        step_s=statistics.median(impl_times),
                                        steps_s=impl_times, stage_s=stage_s))
        if mesh.rank == 1:
            Path(args.out).write_text(json.dumps(results))


# -- the driver --------------------------------------------------------------------------

def launch_ranks(config: Config, balance: list[int], args: argparse.Namespace) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "ranks.json"
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   "--nproc_per_node", "2", __file__, "--worker",
                   "--config", json.dumps(asdict(config)),
                   "--balance", ",".join(map(str, balance)), "--out", str(out),
                   "--warmup", str(args.warmup), "--steps", str(args.steps),
                   "--microbatches", *map(str, args.microbatches),
                   *(["--ours-only"] if getattr(args, "ours_only", False) else [])]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        subprocess.run(command, check=True, env=env)
        return json.loads(out.read_text())


def ideal_step(stage_s: list[float], m: int) -> float:
    return sum(stage_s) + (m - 1) * max(stage_s)


def report(config: Config, balance: list[int], seq1: float, seq2: float,
           runs: list[dict]) -> None:
    tokens = config.batch * config.seq
    steps_of = {(r["impl"], r["schedule"], r["m"]): r["steps_s"] for r in runs}
    rows = [dict(run="sequential, 1 thread", step_s=seq1),
            dict(run="sequential, 2 threads", step_s=seq2)]
    for r in runs:
        ideal = ideal_step(r["stage_s"], r["m"])
        rows.append(dict(run=f"{r['impl']} {SCHEDULES[r['schedule']]}", m=r["m"],
                         step_s=r["step_s"], steps_s=r["steps_s"],
                         vs_torch_pipelining=paired_ratio(
                             steps_of[("torch.pipelining", r["schedule"], r["m"])], r["steps_s"]),
                         vs_plain=paired_ratio(
                             steps_of[("pipeline_lib plain", r["schedule"], r["m"])], r["steps_s"]),
                         fraction_of_ideal=ideal / r["step_s"],
                         ideal_speedup=r["m"] * sum(r["stage_s"]) / ideal,
                         stage_s=r["stage_s"]))
    for row in rows:
        row["tokens_per_s"] = tokens / row["step_s"]
        print(json.dumps({**row, "balance": balance, "config": asdict(config)}))

    print(f"\n{config}, stages {balance} (balance_by_time), 2 ranks x 1 thread on CPU")
    print(f"{'run':<30} {'m':>3} {'tokens/s':>10} {'step s':>8} {'vs torch':>9} "
          f"{'vs plain':>9} {'of ideal':>9}")
    for row in rows:
        m = row.get("m", "")
        versus = f"{row['vs_torch_pipelining']:.2f}x" if "m" in row else ""
        plain = f"{row['vs_plain']:.2f}x" if "m" in row else ""
        ideal = f"{row['fraction_of_ideal']:.0%}" if "m" in row else ""
        print(f"{row['run']:<30} {m:>3} {row['tokens_per_s']:>10.0f} {row['step_s']:>8.3f} "
              f"{versus:>9} {plain:>9} {ideal:>9}")
    speedups = ", ".join(
        f"{SCHEDULES[r['schedule']]} m={r['m']}: {r['m'] * sum(r['stage_s']) / ideal_step(r['stage_s'], r['m']):.2f}x "
        f"(t_s {', '.join(f'{t:.3f}' for t in r['stage_s'])} s)"
        for r in runs if r["impl"] == "pipeline_lib")
    print("vs torch (vs plain): median over steps of torch.pipelining's (pipeline_lib "
          "plain's) step time / this step time, all taking turns step by step.\n"
          "Ideal: t_s is the median forward + backward time of one micro-batch on stage s, "
          "measured in pipeline_lib's timelines; a fill-drain step ideally takes "
          "Σt_s + (m-1)·max t_s, a speedup over one rank of m·Σt_s / (Σt_s + (m-1)·max t_s) "
          f"(p·m/(m+p-1) for equal stages): {speedups}")


def launcher_args(description: str, microbatches: list[int], steps: int,
                  split_flag: str) -> argparse.Namespace:
    """The flags of a benchmark that starts itself again under torchrun: the hidden ones
    (``--worker``, ``--config``, the split, ``--out``) hand each worker its job."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true", help="small model, few steps")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--microbatches", type=int, nargs="+", default=microbatches)
    for hidden in ("--worker", "--ours-only", "--config", split_flag, "--out"):
        parser.add_argument(hidden, help=argparse.SUPPRESS,
                            **({"action": "store_true"} if hidden in ("--worker", "--ours-only")
                               else {}))
    args = parser.parse_args()
    if args.steps is None:
        args.steps = 2 if args.quick else steps
    return args


def launcher_setup(args: argparse.Namespace) -> tuple[Config, torch.Tensor]:
    """The launcher's model config and a micro-batch-sized sample to balance stages with."""
    config = QUICK if args.quick else HEADLINE
    torch.set_num_threads(1)
    return config, batch(config)[0][:config.batch // max(args.microbatches)]


def torchrun_worker(script: str, config: Config, balances: dict[int, list[int]],
                    args: argparse.Namespace, folder: Path) -> list[dict]:
    """Run ``script``'s worker on 2 processes under torchrun, each stage split of
    ``balances`` in turn; its rank 0 writes the runs to a JSON file in ``folder``."""
    out = Path(folder) / "ranks.json"
    here = Path(__file__).resolve().parent
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node", "2", script, "--worker",
               "--config", json.dumps(asdict(config)), "--balances", json.dumps(balances),
               "--out", str(out), "--warmup", str(args.warmup), "--steps", str(args.steps),
               "--microbatches", *map(str, args.microbatches)]
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(here), str(here.parent),
                                          os.environ.get("PYTHONPATH", "")])}
    subprocess.run(command, check=True, env=env)
    return json.loads(out.read_text())


def two_splits_main(doc: str, worker: Callable[[argparse.Namespace], None],
                    launch: Callable[[Config, dict[int, list[int]], argparse.Namespace], list[dict]],
                    report: Callable[[Config, dict[int, list[int]], list[dict]], None]) -> None:
    """A benchmark on 2 ranks holding 1 then 2 stages each (balanced by time), started
    again under torchrun by ``launch``: the launcher, or with ``--worker`` a rank."""
    args = launcher_args(doc.split("\n\n")[0], [8], 5, "--balances")
    if args.worker:
        worker(args)
        return
    config, sample = launcher_setup(args)
    model = build(config)
    balances = {per_rank: balance_by_time(model, sample, 2 * per_rank) for per_rank in (1, 2)}
    report(config, balances, launch(config, balances, args))


def main() -> None:
    args = launcher_args(__doc__.split("\n\n")[0], [4, 8], 4, "--balance")
    if args.worker:
        worker(args)
        return
    config, sample = launcher_setup(args)
    balance = balance_by_time(build(config), sample, 2)
    seq1 = sequential(config, 1, args.warmup, args.steps)
    seq2 = sequential(config, 2, args.warmup, args.steps)
    report(config, balance, seq1, seq2, launch_ranks(config, balance, args))


if __name__ == "__main__":
    main()
