"""Three dimensions on CPU processes: the step of ``tp × pp × dp = 2 × 2 × 2`` runs of
`DistributedPipe` (8 gloo processes, 1F1B), measured, beside the planner's prediction
for the same `Layout` priced on this machine's measured `Cluster`; and each mesh
dimension's bytes, counted in the run, beside the planner's.

    python bench/bench_three_d.py            # (minutes; quiet machine!)
    python bench/bench_three_d.py --quick    # small model, smoke test

Runs, one launch, taking turns step by step (`timing.alternate`): the replicas as DDP
(``replicate``) or FSDP (resharded after forward), each with and without sequence
parallelism. A step is ``pipe.step``: forward, backward and the gradients' reduction over
the replicas, between barriers; no optimizer step. Its prediction is the planner's
``pipeline_time + data_parallel_time``.

The cluster: `plan.local.measure_local_cluster` (one process, one thread: its multiplies'
FLOP/s, its block's bytes/s and per-operation costs, gloo's sends), measured before the
launch. The model is priced from the planner's FLOP and byte formulas: its counted
kernels (`plan.kernels.count_kernels`, what bench_plan.py's CPU runs use) take tp = 1
only, and the formulas miss what each of the many small operations costs on a CPU. Eight
processes share this machine's cores: while all compute, each runs at cores / 8 of one
process's speed, so the compute rates are scaled by min(1, cores / 8) (``--no-share``:
not scaled; the planner's GPUs share nothing). The bytes need no speed: counted in a
step (`parallel.traffic`), they equal `plan.communication.executor_bytes` exactly
(asserted), the planner's `communication_bytes` plus what PyTorch's plans and FSDP2 do
otherwise. Prints one JSON object per run, then a table.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import asdict, replace
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))   # the benchmarks beside this
from bench_distributed import Config, batch, build, lm_loss  # noqa: E402
from timing import Runner, alternate  # noqa: E402

from pipeline_lib.distributed import DistributedPipe, init_mesh  # noqa: E402
from pipeline_lib.distributed.job import process_group  # noqa: E402
from pipeline_lib.parallel import rank_order  # noqa: E402
from pipeline_lib.parallel.traffic import Traffic  # noqa: E402
from pipeline_lib.plan import (Cluster, Layout, Model, communication_bytes,  # noqa: E402
                               executor_bytes, predict)

MESH = {"tp": 2, "pp": 2, "dp": 2}
RANKS = MESH["tp"] * MESH["pp"] * MESH["dp"]
HEADLINE = Config(vocab=4000, d_model=256, layers=4, heads=8, ff=1024, seq=64, batch=32)
QUICK = Config(vocab=1000, d_model=64, layers=2, heads=4, ff=128, seq=16, batch=16)
RUNS = {"DDP": (False, False), "DDP + SP": (False, True), "FSDP": (True, False),
        "FSDP + SP": (True, True)}          # name -> (shard_parameters, sequence_parallel)


def layout(config: Config, m: int, fsdp: bool, sp: bool) -> Layout:
    return Layout(tp=MESH["tp"], pp=MESH["pp"], dp=MESH["dp"], global_batch=config.batch,
                  micro_batch=config.batch // (MESH["dp"] * m), schedule="1f1b",
                  sequence_parallel=sp, distributed_optimizer=fsdp, shard_gradients=fsdp,
                  shard_parameters=fsdp, flash_attention=True)


def spec(config: Config) -> Model:
    return Model(layers=config.layers, hidden=config.d_model, heads=config.heads,
                 seq_len=config.seq, vocab=config.vocab, ffn_hidden=config.ff,
                 tied_embeddings=False)


# -- the 8 ranks (torchrun runs this file with --worker) --------------------------------

def worker(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    config = Config(**json.loads(args.config))
    inputs, target = batch(config)
    balance = [(config.layers + 2) // MESH["pp"]] * MESH["pp"]
    with process_group(backend="gloo", timeout=600):
        mesh = init_mesh(MESH["pp"], MESH["dp"], 300, rank_order.MEGATRON, tp=MESH["tp"])
        pipes = {name: DistributedPipe(build(config), mesh, balance, args.microbatches,
                                       "1f1b", sequence_parallel=sp, shard_parameters=fsdp)
                 for name, (fsdp, sp) in RUNS.items()}
        sent = {}
        for name, pipe in pipes.items():    # the messages' layouts agreed, then counted
            pipe.step(inputs, target, lm_loss)
            with Traffic({"tp": mesh.tp_group, "dp": mesh.dp_group,
                          "pp": list(mesh.channels.values())}) as traffic:
                pipe.step(inputs, target, lm_loss)
            sent[name] = traffic.sent()

        def zero_grad(pipe: DistributedPipe):
            return lambda: [setattr(p, "grad", None) for p in pipe.parameters()]

        runners = {name: Runner(lambda pipe=pipe: pipe.step(inputs, target, lm_loss),
                                zero_grad(pipe)) for name, pipe in pipes.items()}
        times = alternate(runners, args.warmup, args.steps, sync=dist.barrier)
        found = [None] * RANKS
        dist.all_gather_object(found, dict(pipe_rank=mesh.pipe_rank, sent=sent))
        if mesh.rank == 0:
            Path(args.out).write_text(json.dumps(dict(times=times, ranks=found)))


def launch(config: Config, args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "ranks.json"
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   "--nproc_per_node", str(RANKS), __file__, "--worker",
                   "--config", json.dumps(asdict(config)), "--out", str(out),
                   "--microbatches", str(args.microbatches), "--warmup", str(args.warmup),
                   "--steps", str(args.steps)]
        subprocess.run(command, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        return json.loads(out.read_text())


# -- the driver ------------------------------------------------------------------------

def shared(cluster: Cluster, share: float) -> Cluster:
    """``cluster`` with its compute ``share`` times as fast: what a process gets of the
    cores while all the ranks compute."""
    return replace(cluster, peak_flops=cluster.peak_flops * share,
                   hbm_bandwidth=cluster.hbm_bandwidth * share,
                   kernel_overhead=cluster.kernel_overhead / share,
                   backward_overhead=cluster.backward_overhead / share,
                   action_overhead=cluster.action_overhead / share)


def rows_of(config: Config, cluster: Cluster, run: dict, m: int, load: str) -> list[dict]:
    model = spec(config)
    rows = []
    for name, (fsdp, sp) in RUNS.items():
        plan_layout = layout(config, m, fsdp, sp)
        plan = predict(model, cluster, plan_layout)
        expected = executor_bytes(model, cluster, plan_layout)
        planned = communication_bytes(model, cluster, plan_layout)
        for rank in run["ranks"]:
            got, want = rank["sent"][name], expected[rank["pipe_rank"]]
            for dim in want:
                assert abs(got.get(dim, 0.0) - want[dim]) <= 1e-9 * max(want[dim], 1.0), \
                    (name, rank, dim, got, want)
        measured = statistics.median(run["times"][name])
        predicted = plan.pipeline_time + plan.data_parallel_time
        rows.append(dict(run=name, m=m, measured_s=measured, steps_s=run["times"][name],
                         predicted_s=predicted, error=predicted / measured - 1,
                         bytes_counted=expected, bytes_planner=planned,
                         machine_load=load, config=asdict(config), cluster=cluster.__dict__))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small model, few steps")
    parser.add_argument("--microbatches", type=int, default=4, help="per replica")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--no-share", action="store_true",
                        help="price each rank at one process's speed")
    for hidden in ("--worker", "--config", "--out"):
        parser.add_argument(hidden, help=argparse.SUPPRESS,
                            **({"action": "store_true"} if hidden == "--worker" else {}))
    args = parser.parse_args()
    args.steps = args.steps or (2 if args.quick else 6)
    if args.worker:
        worker(args)
        return
    from pipeline_lib.plan.local import measure_local_cluster

    config = QUICK if args.quick else HEADLINE
    torch.set_num_threads(1)
    micro = config.batch // (MESH["dp"] * args.microbatches)
    cores = len(os.sched_getaffinity(0))
    load = f"load average {os.getloadavg()[0]:.1f} on {cores} cores before the run"
    cluster = measure_local_cluster(1, RANKS, spec(config), micro, block=build(config)[1])
    share = 1.0 if args.no_share else min(1.0, cores / RANKS)
    run = launch(config, args)
    rows = rows_of(config, shared(cluster, share), run, args.microbatches, load)
    for row in rows:
        print(json.dumps(row))
    print(f"\n{config}, tp x pp x dp = 2 x 2 x 2, 1F1B, m = {args.microbatches}, compute share "
          f"{share:.2f}; {load}")
    print(f"{'run':<10} {'measured s':>11} {'predicted s':>12} {'error':>7}   bytes per "
          f"step, pipe rank 0 (counted = executor_bytes; planner's)")
    for r in rows:
        counted0, planned0 = r["bytes_counted"][0], r["bytes_planner"][0]
        said = ", ".join(f"{d} {counted0[d]:,.0f} ({planned0[d]:,.0f})" for d in counted0)
        print(f"{r['run']:<10} {r['measured_s']:>11.4f} {r['predicted_s']:>12.4f} "
              f"{r['error']:>+7.1%}   {said}")


if __name__ == "__main__":
    main()
