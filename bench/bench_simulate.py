"""How long `validate` and `simulate` take as pipelines grow: linear in the actions.

Prints one JSON line per (schedule, ranks, micro-batches), then a table. Each time is the
best of ``--repeats`` runs, as wall-clock and as this process's CPU time (on a shared
machine the CPU time is the steadier of the two). Time per action staying flat as the
pipeline grows is what linear means; the issue's target is ``simulate`` of 1F1B at
p = 64, m = 1000 (128,000 actions) under 2 s.

    python bench/bench_simulate.py               # the README's table
    python bench/bench_simulate.py --quick       # smoke test
"""
from __future__ import annotations

import argparse
import json
import platform
import time
from typing import Callable

from pipeline_lib.schedules import build, validate
from pipeline_lib.timeline import simulate

TARGET = ("1f1b", 64, 1000, 2.0)   # schedule, ranks, micro-batches, seconds


def best(run: Callable[[], object], repeats: int) -> tuple[float, float]:
    """Best wall-clock and best CPU seconds of ``repeats`` runs."""
    walls, cpus = [], []
    for _ in range(repeats):
        wall, cpu = time.perf_counter(), time.process_time()
        run()
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    return min(walls), min(cpus)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, one repeat")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    names = ["1f1b", "zb_h1", "interleaved_1f1b", "zb_v", "dualpipe_v"]
    if args.quick:
        sizes, repeats = [(4, 16), (8, 100)], 1
    else:
        sizes, repeats = [(8, 100), (16, 250), (32, 500), (64, 1000)], args.repeats
    rows = []
    for name in names:
        for ranks, microbatches in sizes:
            schedule = build(name, ranks, microbatches)
            actions = sum(map(len, schedule.actions))
            validate_wall, validate_cpu = best(lambda: validate(schedule), repeats)
            simulate_wall, simulate_cpu = best(lambda: simulate(schedule), repeats)
            row = {"schedule": name, "ranks": ranks, "microbatches": microbatches,
                   "actions": actions, "validate_s": validate_wall,
                   "validate_cpu_s": validate_cpu, "simulate_s": simulate_wall,
                   "simulate_cpu_s": simulate_cpu,
                   "simulate_us_per_action": 1e6 * simulate_cpu / actions,
                   "python": platform.python_version(), "machine": platform.machine()}
            print(json.dumps(row), flush=True)
            rows.append(row)

    print("\n| schedule | p | m | actions | validate (s) | simulate (s) | simulate CPU (s) "
          "| µs per action |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['schedule']} | {r['ranks']} | {r['microbatches']} | {r['actions']:,} | "
              f"{r['validate_s']:.2f} | {r['simulate_s']:.2f} | {r['simulate_cpu_s']:.2f} | "
              f"{r['simulate_us_per_action']:.1f} |")
    name, ranks, microbatches, limit = TARGET
    target = [r for r in rows if (r["schedule"], r["ranks"], r["microbatches"])
              == (name, ranks, microbatches)]
    if target:
        seconds = target[0]["simulate_s"]
        print(f"\nsimulate({name}, p={ranks}, m={microbatches}): {seconds:.2f} s wall, "
              f"target < {limit:g} s: {'met' if seconds < limit else 'NOT met'}")


if __name__ == "__main__":
    main()
