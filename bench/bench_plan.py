"""The planner (`pipeline_lib.plan`): how fast its search is, and how well it predicts.

    python bench/bench_plan.py                 # search time for every Narayanan et al. row
    python bench/bench_plan.py --local         # this machine measured, bench_distributed's
    python bench/bench_plan.py --local --quick #   runs predicted and run (minutes; quiet!)

Search: `search` on each row of Narayanan et al. 2021, Table 1 (the 1T row, 3,072 GPUs,
is the issue's target: under 10 s on 2 cores), ``--repeats`` times, the median kept; with
each, the published layout's predicted step and the best found, and how they differ.

Local: `measure_local_cluster` (one matmul, one copy, gloo sends), then
bench/bench_distributed.py's own runs (2 ranks × 1 thread, GPipe and 1F1B, m = 4 and 8,
its "pipeline_lib" rows), each next to `predict`'s pipeline time. That benchmark times
forward and backward between barriers, no optimizer step, so the comparison is with
`Plan.pipeline_time` (the simulated makespan), not `step_time`. Its stages come from
`balance_by_time`; the planner splits the blocks evenly, the embedding on the first rank
and the vocabulary projection and loss on the last. The model's blocks are
`nn.TransformerEncoderLayer`s, whose causal attention runs in PyTorch's fused CPU kernel
(scaled_dot_product_attention): ``flash_attention=True``.
Prints one JSON object per row, then a table.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))   # bench_distributed, beside this
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))   # the published rows

from pipeline_lib.plan import CLUSTERS, Layout, Model, predict, search  # noqa: E402
from pipeline_lib.plan.search import differences  # noqa: E402


def bench_search(repeats: int) -> None:
    from test_plan import RUNS   # the published rows, with their citations
    rows = []
    for run in RUNS:
        if run.cluster_name != "A100-80GB":
            continue
        times, result = [], None
        for _ in range(repeats if run.name == "1008B" else 1):
            start = time.perf_counter()
            result = search(run.model, CLUSTERS[run.cluster_name], run.layout.gpus,
                            run.layout.global_batch)
            times.append(time.perf_counter() - start)
        published = predict(run.model, CLUSTERS[run.cluster_name], run.layout)
        best = result.best
        row = dict(run=run.name, gpus=run.layout.gpus, search_s=statistics.median(times),
                   search_times_s=times, layouts=len(result.ranked),
                   rejected=len(result.rejected), measured_step_s=run.step_time,
                   published_predicted_s=published.step_time, best_predicted_s=best.step_time,
                   best_memory_gb=best.memory / 1e9,
                   differs=differences(best.layout, run.layout))
        rows.append(row)
        print(json.dumps(row))
    print(f"\n{'run':>7} {'GPUs':>5} {'search s':>9} {'fit':>6} {'rejected':>9} "
          f"{'measured s':>11} {'predicted s':>12} {'best s':>7}  best differs in")
    for r in rows:
        print(f"{r['run']:>7} {r['gpus']:>5} {r['search_s']:>9.2f} {r['layouts']:>6} "
              f"{r['rejected']:>9} {r['measured_step_s']:>11.2f} "
              f"{r['published_predicted_s']:>12.2f} {r['best_predicted_s']:>7.2f}  "
              f"{r['differs']}")


def bench_local(quick: bool, steps: int | None) -> None:
    import torch
    from bench_distributed import HEADLINE, QUICK, SCHEDULES, batch, build, launch_ranks
    from pipeline_lib.partition import balance_by_time
    from pipeline_lib.plan.local import measure_local_cluster

    cluster = measure_local_cluster(threads=1, ranks=2)
    print(json.dumps(dict(cluster=cluster.__dict__)))
    config = QUICK if quick else HEADLINE
    model = Model(layers=config.layers, hidden=config.d_model, heads=config.heads,
                  seq_len=config.seq, vocab=config.vocab, ffn_hidden=config.ff)
    microbatches = [4, 8]
    torch.set_num_threads(1)
    sample = batch(config)[0][:config.batch // max(microbatches)]
    balance = balance_by_time(build(config), sample, 2)
    args = argparse.Namespace(warmup=1, steps=steps or (2 if quick else 4),
                              microbatches=microbatches)
    rows = []
    for run in launch_ranks(config, balance, args):
        if run["impl"] != "pipeline_lib":
            continue
        layout = Layout(pp=2, micro_batch=config.batch // run["m"], global_batch=config.batch,
                        schedule=run["schedule"], flash_attention=True)
        plan = predict(model, cluster, layout)
        row = dict(schedule=SCHEDULES[run["schedule"]], m=run["m"], measured_s=run["step_s"],
                   predicted_s=plan.pipeline_time,
                   error=plan.pipeline_time / run["step_s"] - 1, balance=balance,
                   config=config.__dict__)
        rows.append(row)
        print(json.dumps(row))
    print(f"\n{'schedule':>8} {'m':>3} {'measured s':>11} {'predicted s':>12} {'error':>7}")
    for r in rows:
        print(f"{r['schedule']:>8} {r['m']:>3} {r['measured_s']:>11.3f} "
              f"{r['predicted_s']:>12.3f} {r['error']:>+7.1%}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--local", action="store_true",
                        help="measure this machine and predict bench_distributed's runs")
    parser.add_argument("--quick", action="store_true", help="with --local: small model")
    parser.add_argument("--steps", type=int, default=None, help="with --local: timed steps")
    parser.add_argument("--repeats", type=int, default=3, help="searches of the 1T row")
    args = parser.parse_args()
    if args.local:
        bench_local(args.quick, args.steps)
    else:
        bench_search(args.repeats)


if __name__ == "__main__":
    main()
