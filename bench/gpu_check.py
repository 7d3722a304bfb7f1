"""`make gpu-check`: run the GPU tests, then time `Pipe.step` on two GPUs against the ideal.

    python bench/gpu_check.py                  # on a CPU-only machine everything skips
    python bench/gpu_check.py --microbatches 4 --batch 32

Prints a pass/fail table of every test of tests/test_gpu.py (the executors on GPUs) and
tests/test_gpu_real_run.py (a real run on 2 GPUs: each rank on its own GPU over NCCL,
bfloat16, global gradient clipping, checkpoints resumed on another layout, and
`lm.train` with all of them), with the area each checks and why a test skipped; then, with
two GPUs or more, one JSON line and a table row: `Pipe.step` of the tutorial's
1.4-billion-parameter model split over 2 GPUs, against the same step on one GPU, as a
fraction of the ideal speedup p·m/(m+p−1) of a fill-drain pipeline. Exits 1 if a test
failed.
"""
from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from pipeline_lib import Pipe
from pipeline_lib.lm.model import transformer_lm
from timing import Runner, alternate, paired_ratio  # bench/timing.py, beside this file

REPO = Path(__file__).resolve().parent.parent
TUTORIAL_VOCAB = 28_782   # WikiText-2's, as in the tutorial


class Results:
    """A pytest plugin that keeps each test's outcome, and a skip's reason."""

    def __init__(self) -> None:
        self.outcomes: dict[str, tuple[str, str]] = {}

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.failed:
            self.outcomes[report.nodeid] = ("FAILED", f"in {report.when}")
        elif report.skipped:
            self.outcomes[report.nodeid] = ("skipped", report.longrepr[2].removeprefix("Skipped: "))
        elif report.when == "call":
            self.outcomes[report.nodeid] = ("passed", "")


TEST_FILES = ("test_gpu.py", "test_gpu_real_run.py")
# what a test checks, by a word of its name (the first that matches); else "executors"
AREAS = (("nccl", "NCCL"), ("bf16", "bf16"), ("clip", "clipping"), ("resume", "resume"),
         ("training_program", "lm.train"))


def area(test: str) -> str:
    return next((name for word, name in AREAS if word in test), "executors")


def run_gpu_tests() -> bool:
    """Run the GPU tests in this process, print a pass/fail table; True if none failed."""
    results = Results()
    pytest.main([*(str(REPO / "tests" / f) for f in TEST_FILES), "-q", "-p", "no:cacheprovider",
                 "--no-header", "--no-summary"], plugins=[results])
    print(f"\nGPU tests ({torch.cuda.device_count()} GPU(s) found):")
    print(f"  {'result':8} {'area':10} test")
    for nodeid, (outcome, why) in results.outcomes.items():
        test = nodeid.split("::")[-1]
        print(f"  {outcome:8} {area(test):10} {test}" + (f"  ({why})" if why else ""))
    if all(outcome == "skipped" for outcome, _ in results.outcomes.values()):
        print("  every GPU test skipped: nothing on the GPU paths was checked")
    return not any(outcome == "FAILED" for outcome, _ in results.outcomes.values())


def token_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def pipe_efficiency(m: int, batch: int, seq: int, schedule: str, steps: int) -> dict:
    """`Pipe.step` on GPUs 0 and 1 against the whole model stepping on GPU 0."""
    p, balance = 2, [7, 7]   # embedding + 6 blocks | 6 blocks + decoder
    torch.manual_seed(0)
    with torch.device("cuda:0"):
        model = transformer_lm(TUTORIAL_VOCAB, "tutorial")
    pipe = Pipe(copy.deepcopy(model), chunks=m, checkpoint="never", balance=balance,
                devices=["cuda:0", "cuda:1"])
    inputs = torch.randint(0, TUTORIAL_VOCAB, (batch, seq), device="cuda:0")
    target = torch.randint(0, TUTORIAL_VOCAB, (batch, seq), device="cuda:0")
    times = alternate({
        "one GPU": Runner(lambda: token_loss(model(inputs), target).backward(),
                          lambda: model.zero_grad(set_to_none=True)),
        "Pipe": Runner(lambda: pipe.step(inputs, target, token_loss, schedule),
                       lambda: pipe.zero_grad(set_to_none=True)),
    }, warmup=2, steps=steps, sync=lambda: [torch.cuda.synchronize(k) for k in range(p)])
    speedup, ideal = paired_ratio(times["one GPU"], times["Pipe"]), p * m / (m + p - 1)
    return {"model": "tutorial", "gpus": p, "balance": balance, "microbatches": m,
            "batch": batch, "seq": seq, "schedule": schedule, "gpu": torch.cuda.get_device_name(0),
            "speedup": round(speedup, 3), "ideal": round(ideal, 3),
            "fraction_of_ideal": round(speedup / ideal, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--batch", type=int, default=64, help="sequences per mini-batch")
    parser.add_argument("--seq", type=int, default=35, help="tokens per sequence (bptt)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps of each")
    args = parser.parse_args()
    passed = run_gpu_tests()
    gpus = torch.cuda.device_count()
    print("\nPipe.step on 2 GPUs, tutorial preset, as a fraction of p·m/(m+p−1):")
    if gpus < 2:
        print(f"  not measured: it needs 2 GPUs, this machine has {gpus}")
    else:
        rows = [pipe_efficiency(args.microbatches, args.batch, args.seq, schedule, args.steps)
                for schedule in ("gpipe", "1f1b")]
        for row in rows:
            print(json.dumps(row))
        print(f"  {'schedule':9} {'m':>3} {'speedup':>8} {'ideal':>6} {'fraction':>9}")
        for row in rows:
            print(f"  {row['schedule']:9} {row['microbatches']:>3} {row['speedup']:>8.2f} "
                  f"{row['ideal']:>6.2f} {row['fraction_of_ideal']:>9.2f}")
    sys.exit(0 if passed else 1)


if __name__ == "__main__":
    main()
