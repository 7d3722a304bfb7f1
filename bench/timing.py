"""Timing implementations side by side on a machine whose speed drifts.

A shared or throttled CPU can run 10-20% faster or slower from one minute to the next, so
timing one implementation after another compares the machine, not the code. Here they
take turns step by step (in alternating order), and each comparison is the median of
per-turn ratios.

The allocator setting the CPU benchmarks rely on lives in the library, where `Pipe` applies
it: `pipeline_lib.threaded.allocator`.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable


@dataclass
class Runner:
    """One implementation's training step; ``after`` runs after each measured step,
    outside the timing."""

    step: Callable[[], object]
    zero_grad: Callable[[], None]
    after: Callable[[], None] = lambda: None


def alternate(runners: dict[str, Runner], warmup: int, steps: int,
              sync: Callable[[], None] = lambda: None) -> dict[str, list[float]]:
    """Seconds per measured step of each runner. ``sync`` runs right before and after each
    timed step (a barrier, so that every rank has finished its part)."""
    times: dict[str, list[float]] = {name: [] for name in runners}
    for k in range(warmup + steps):
        for name in sorted(runners, reverse=k % 2 == 1):
            runner = runners[name]
            runner.zero_grad()
            sync()
            start = time.perf_counter()
            runner.step()
            sync()
            if k >= warmup:
                times[name].append(time.perf_counter() - start)
                runner.after()
    return times


def paired_ratio(baseline: list[float], other: list[float]) -> float:
    """How many times faster ``other`` is than ``baseline``, turn by turn, median."""
    return statistics.median(b / o for b, o in zip(baseline, other))
