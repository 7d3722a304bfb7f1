"""Timing several ways of doing one thing, fairly, on a machine others may share (notebook 03).

A notebook that compares two balances or three checkpointing modes times each a few
times. Run one after the other, a change in the machine's load would fall on one of them
only; so `take_turns` runs them in turns, the order reversed every other turn, after one
warm-up turn (the allocator's first allocations, lazy initialisation) that is not kept.
`machine_load` says in words how busy the machine was, so that a printed timing comes
with its measured excuse rather than a guess.
"""
from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Mapping
from typing import TypeVar

import torch

__all__ = ["Turn", "take_turns", "median_turn", "median_seconds", "machine_load",
           "loss_seconds"]

T = TypeVar("T")
#: One timed call: wall-clock seconds and what the call returned.
Turn = tuple[float, T]


def take_turns(runs: Mapping[str, Callable[[], T]], turns: int) -> dict[str, list[Turn]]:
    """Call every run ``turns`` times (plus one warm-up turn, dropped), taking turns.

    Returns each run's ``(seconds, result)`` per kept turn, in the order they ran.
    """
    if turns < 1:
        raise ValueError(f"turns must be at least 1, got {turns}")
    if not runs:
        raise ValueError("runs is empty: give at least one name -> function")
    kept: dict[str, list[Turn]] = {name: [] for name in runs}
    for turn in range(1 + turns):
        for name in sorted(runs, reverse=turn % 2 == 1):
            start = time.perf_counter()
            result = runs[name]()
            seconds = time.perf_counter() - start
            if turn:
                kept[name].append((seconds, result))
    return kept


def median_turn(turns: list[Turn]) -> Turn:
    """The turn of median length (of an even number, the shorter of the middle two)."""
    if not turns:
        raise ValueError("no turns to take the median of")
    return sorted(turns, key=lambda turn: turn[0])[(len(turns) - 1) // 2]


def machine_load() -> str:
    """How busy the machine was (the 1-minute load average against the cores), in words."""
    load, cores = os.getloadavg()[0], os.cpu_count() or 1
    if load > cores + 0.5:    # the load counts the notebook's own threads too
        return (f"the machine was busy (load average {load:.1f} on {cores} cores, this "
                f"notebook's threads included), so the stage threads did not have a core "
                f"each to themselves")
    return (f"the machine was otherwise idle (load average {load:.1f} on {cores} cores, "
            f"this notebook's threads included)")


def median_seconds(turns: list[Turn]) -> float:
    """The median of the turns' seconds."""
    return statistics.median(seconds for seconds, _ in turns)


def loss_seconds(loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 target: torch.Tensor, classes: int, device: torch.device | str,
                 repeats: int = 5) -> float:
    """The loss alone, forward and backward, on one micro-batch of logits (``classes`` per
    target), median of ``repeats`` after a warm-up: timed directly, since its cost does
    not depend on the logits' values, so it cannot come out negative as a difference of
    two separately timed, noisy decoder times can."""
    device = torch.device(device)
    logits = torch.randn(*target.shape, classes, device=device)
    target = target.to(device)
    runs = []
    for _ in range(1 + repeats):                  # the first warms up
        leaf = logits.clone().requires_grad_()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        loss_fn(leaf, target).backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        runs.append(time.perf_counter() - start)
    return statistics.median(runs[1:])

