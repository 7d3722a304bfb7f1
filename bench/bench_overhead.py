"""What `Pipe.step` costs on top of the model's own work: a Pipe of 1, 2 and 4 stages at
m = 1 against the plain module's forward and backward, side by side (issues 24 and 34:
within 3%).

The model is notebook 03's Transformer LM (``transformer_lm``, cpu preset: d_model 128,
4 layers, dropout 0.2) with a 2,000-word vocabulary, on batches of 20 × 35 tokens, in
training mode, so dropout draws random numbers in every run. At m = 1 the stages run one
after another, so what a Pipe of several stages adds is its own: a thread per stage, the
hand-overs between them, and the random streams of stage threads (`rng.shared_rng`).
The row "2 stages, streams by dispatch mode" runs the same 2-stage Pipe with the streams
it had before issue 34 (`rng.microbatch_rng`: every aten op through Python). The runs
take turns step by step, in alternating order (bench/timing.py), on the same weights and
batch, and each ratio is the median of per-turn ratios. A run that does less than the
plain step is not what this measures: all compute the same loss and gradients (checked
first).

    python bench/bench_overhead.py               # 10 warm-up + 200 turns (about 5 minutes)
    python bench/bench_overhead.py --quick       # smoke test
    python bench/bench_overhead.py --turns 400 --threads 1

Prints one JSON line, then a table.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import json
import platform
import statistics
from typing import Callable, Iterator
from unittest import mock

import torch

from pipeline_lib import Pipe, rng
from pipeline_lib.lm.loops import lm_loss
from pipeline_lib.lm.model import transformer_lm
from timing import Runner, alternate, paired_ratio  # bench/timing.py, beside this file

TARGET = 1.03          # issues 24, 34: a Pipe step at m = 1 within 3% of the plain step
VOCABULARY, BATCH, TOKENS = 2000, 20, 35
BALANCES = {1: [6], 2: [3, 3], 4: [2, 1, 1, 2]}   # embedding, 4 blocks, decoder


def check_same_gradients(model: torch.nn.Sequential, pipe: Pipe, x: torch.Tensor,
                         y: torch.Tensor) -> None:
    """Without dropout, the two runs must compute the same gradients: otherwise the
    comparison would time two different things."""
    plain, piped = copy.deepcopy(model).eval(), copy.deepcopy(pipe).eval()
    lm_loss(plain(x), y).backward()
    piped.step(x, y, lm_loss)
    for (name, a), b in zip(plain.named_parameters(), piped.parameters()):
        torch.testing.assert_close(a.grad, b.grad, msg=lambda m: f"{name}: {m}")


@contextlib.contextmanager
def dispatch_mode_streams() -> Iterator[None]:
    """A step with the stage threads' random streams of before issue 34."""
    with mock.patch("pipeline_lib.threaded.pipe.streams_for", lambda ranks: rng.microbatch_rng):
        yield


def pipe_runner(pipe: Pipe, x: torch.Tensor, y: torch.Tensor,
                around: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
                ) -> Runner:
    def step() -> None:
        with around():
            pipe.step(x, y, lm_loss)
    return Runner(step, lambda: pipe.zero_grad(set_to_none=True))


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
    pipes = {n: Pipe(copy.deepcopy(model), chunks=1, balance=balance).train()
             for n, balance in BALANCES.items()}
    for pipe in pipes.values():
        check_same_gradients(model, pipe, x, y)

    runners = {"plain": Runner(lambda: lm_loss(model(x), y).backward(),
                               lambda: model.zero_grad(set_to_none=True)),
               **{f"pipe{n}": pipe_runner(pipe, x, y) for n, pipe in pipes.items()},
               "pipe2 dispatch": pipe_runner(copy.deepcopy(pipes[2]), x, y,
                                             dispatch_mode_streams)}
    times = alternate(runners, warmup, turns)
    rows = []
    for name, label in (("pipe1", "1 stage"), ("pipe2", "2 stages"), ("pipe4", "4 stages"),
                        ("pipe2 dispatch", "2 stages, streams by dispatch mode")):
        ratio = 1 / paired_ratio(times["plain"], times[name])   # pipe time / plain time
        rows.append({"bench": "overhead", "run": label, "microbatches": 1,
                     "model": "transformer_lm cpu preset, dropout 0.2",
                     "vocabulary": VOCABULARY, "batch": [BATCH, TOKENS], "turns": turns,
                     "threads": torch.get_num_threads(),
                     "plain_step_s": statistics.median(times["plain"]),
                     "pipe_step_s": statistics.median(times[name]),
                     "pipe_over_plain": ratio, "target": TARGET, "within_target": ratio <= TARGET,
                     "machine": platform.processor() or platform.machine(),
                     "torch": torch.__version__})
    for row in rows:
        print(json.dumps(row), flush=True)
    print()
    print("| run | median step | vs plain |")
    print("|---|---|---|")
    print(f"| plain forward + backward | {rows[0]['plain_step_s'] * 1e3:.2f} ms | 1.000× |")
    for row in rows:
        print(f"| Pipe.step, m = 1, {row['run']} | {row['pipe_step_s'] * 1e3:.2f} ms "
              f"| {row['pipe_over_plain']:.3f}× |")
    met = all(row["within_target"] for row in rows[:3])
    print(f"\ntarget: ≤ {TARGET:.2f}× for 1, 2 and 4 stages ({'met' if met else 'NOT met'})")


if __name__ == "__main__":
    main()
