"""What `Pipe.step` costs on top of the model's own work: a one-stage Pipe at m = 1 against
the plain module's forward and backward, side by side (issue 24: within 3%).

The model is notebook 03's Transformer LM (``transformer_lm``, cpu preset: d_model 128,
4 layers, dropout 0.2) with a 2,000-word vocabulary, on batches of 20 × 35 tokens, in
training mode, so dropout draws random numbers in both runs. The two runs take turns
step by step, in alternating order (bench/timing.py), on the same weights and batch, and
each ratio is the median of per-turn ratios. A run that does less than the plain step is
not what this measures: both compute the same loss and gradients (checked first).

    python bench/bench_overhead.py               # 10 warm-up + 200 turns (about 2 minutes)
    python bench/bench_overhead.py --quick       # smoke test
    python bench/bench_overhead.py --turns 400 --threads 1

Prints one JSON line, then a table.
"""
from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics

import torch

from pipeline_lib import Pipe
from pipeline_lib.lm.loops import lm_loss
from pipeline_lib.lm.model import transformer_lm
from timing import Runner, alternate, paired_ratio  # bench/timing.py, beside this file

TARGET = 1.03          # issue 24: a one-stage Pipe step within 3% of the plain step
VOCABULARY, BATCH, TOKENS = 2000, 20, 35


def check_same_gradients(model: torch.nn.Sequential, pipe: Pipe, x: torch.Tensor,
                         y: torch.Tensor) -> None:
    """Without dropout, the two runs must compute the same gradients: otherwise the
    comparison would time two different things."""
    plain, piped = copy.deepcopy(model).eval(), copy.deepcopy(pipe).eval()
    lm_loss(plain(x), y).backward()
    piped.step(x, y, lm_loss)
    for (name, a), b in zip(plain.named_parameters(), piped.parameters()):
        torch.testing.assert_close(a.grad, b.grad, msg=lambda m: f"{name}: {m}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--turns", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--threads", type=int, default=None,
                        help="intra-op threads (default: PyTorch's)")
    parser.add_argument("--quick", action="store_true", help="a few turns, as a smoke test")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    turns, warmup = (5, 1) if args.quick else (args.turns, args.warmup)

    torch.manual_seed(0)
    model = transformer_lm(VOCABULARY, "cpu").train()
    x = torch.randint(0, VOCABULARY, (BATCH, TOKENS))
    y = torch.randint(0, VOCABULARY, (BATCH, TOKENS))
    pipe = Pipe(copy.deepcopy(model), chunks=1, balance=[len(model)]).train()
    check_same_gradients(model, pipe, x, y)

    runners = {
        "plain": Runner(lambda: lm_loss(model(x), y).backward(),
                        lambda: model.zero_grad(set_to_none=True)),
        "pipe": Runner(lambda: pipe.step(x, y, lm_loss),
                       lambda: pipe.zero_grad(set_to_none=True)),
    }
    times = alternate(runners, warmup, turns)
    ratio = 1 / paired_ratio(times["plain"], times["pipe"])   # pipe time / plain time
    row = {"bench": "overhead", "model": "transformer_lm cpu preset, dropout 0.2",
           "vocabulary": VOCABULARY, "batch": [BATCH, TOKENS], "turns": turns,
           "threads": torch.get_num_threads(),
           "plain_step_s": statistics.median(times["plain"]),
           "pipe_step_s": statistics.median(times["pipe"]),
           "pipe_over_plain": ratio, "target": TARGET, "within_target": ratio <= TARGET,
           "machine": platform.processor() or platform.machine(), "torch": torch.__version__}
    print(json.dumps(row), flush=True)
    print()
    print("| run | median step | vs plain |")
    print("|---|---|---|")
    print(f"| plain forward + backward | {row['plain_step_s'] * 1e3:.2f} ms | 1.000× |")
    print(f"| one-stage Pipe.step, m = 1 | {row['pipe_step_s'] * 1e3:.2f} ms | {ratio:.3f}× |")
    print(f"\ntarget: ≤ {TARGET:.2f}× ({'met' if row['within_target'] else 'NOT met'})")


if __name__ == "__main__":
    main()
