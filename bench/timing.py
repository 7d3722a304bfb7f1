"""Timing implementations side by side on a machine whose speed drifts.

A shared or throttled CPU can run 10-20% faster or slower from one minute to the next, so
timing one implementation after another compares the machine, not the code. Here they
take turns step by step (in alternating order), and each comparison is the median of
per-turn ratios.
"""
from __future__ import annotations

import ctypes
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


def keep_freed_memory() -> bool:
    """Make glibc keep freed memory mapped instead of returning it after every step.

    By default glibc serves large blocks with their own mmap (above a threshold that
    starts at 128 KiB and rises as such blocks are freed), trims the heap's free top and
    deletes a thread arena's emptied heaps, so every training step faults its
    activations' pages in again: about 300 000 minor page faults per step of bench_pipe's
    model, sequential or pipelined, and the stage threads fault into one shared address
    space. Raising the mmap and trim thresholds and the top pad (what
    MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_ and MALLOC_TOP_PAD_ do; caching
    allocators such as jemalloc keep memory by design) leaves a few dozen faults per step.
    Every thread also allocates from the main arena (MALLOC_ARENA_MAX=1): a thread
    arena's heaps hold at most 64 MiB, so a stage thread's blocks of 32 MiB (a
    feed-forward activation at batch 64, m = 1) were mapped and faulted in again each
    step, 65 000 faults that the sequential run on the main thread did not pay.
    Blocks of 32 MiB and more (glibc's largest threshold) still get a mapping of their own
    where no free memory in the heap holds them.
    Call it before any thread allocates. Returns False unless glibc took every setting.
    """
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_top_pad, m_mmap_threshold, m_arena_max = -1, -2, -3, -8
    taken = [mallopt(option, value) == 1 for option, value in [
        (m_mmap_threshold, 32 << 20), (m_trim_threshold, 1 << 30), (m_top_pad, 512 << 20),
        (m_arena_max, 1)]]
    return all(taken)
