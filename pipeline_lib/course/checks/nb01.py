"""Checks of notebook 01's exercises (naive model parallelism and GPipe).

Each ``check_*`` takes the learner's functions, runs them where the library functions that
*are* the answer are withheld, and raises `ExerciseFailed` with what is wrong. Where the
result alone cannot tell a wrong method from the right one (a whole-batch backward gives
the right gradients too), the check watches *how* the answer works.
"""
from __future__ import annotations

import copy
import math
from collections.abc import Callable
from fractions import Fraction
from typing import Any

import torch
from torch import nn

from pipeline_lib.course.exercises import ExerciseFailed, withheld
from pipeline_lib.microbatch import gather, loss_weights, split
from pipeline_lib.schedules import gpipe
from pipeline_lib.timeline import bubble_theory, simulate

Namespace = dict[str, Any] | None


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ExerciseFailed(message)


def check_split_and_gather(split_rows: Callable, gather_rows: Callable,
                           namespace: Namespace = None) -> None:
    """Exercise 1.1: sizes and rows against the library's `split` and `gather`, computed
    before the learner's code runs with both withheld."""
    for rows, m in [(8, 4), (10, 4), (7, 7), (5, 1), (11, 3)]:
        batch = torch.arange(rows * 3, dtype=torch.float32).reshape(rows, 3)
        library = split(batch, m)
        expected = [len(c) for c in library]
        with withheld(split, gather):
            mine = split_rows(batch, m)
            joined = gather_rows(list(library))
        _require(isinstance(mine, (list, tuple)) and len(mine) == m,
                 f"split_rows(a batch of {rows} rows, {m}) must return a list of {m} "
                 f"tensors, got {mine!r}")
        sizes = [len(c) for c in mine]
        _require(sizes == expected, f"{rows} rows in {m} micro-batches: your sizes are "
                                    f"{sizes}, expected {expected} (as equal as possible, "
                                    f"larger ones first)")
        _require(all(torch.equal(a, b) for a, b in zip(mine, library)),
                 f"{rows} rows in {m}: the sizes are right but the rows are not: "
                 f"micro-batch k must hold the next rows in order")
        _require(isinstance(joined, torch.Tensor) and torch.equal(joined, batch),
                 f"gather_rows of {m} micro-batches of {rows} rows does not give back the "
                 f"batch, in order: join them along dim 0")
    torch.manual_seed(0)      # a model run micro-batch by micro-batch: the unsplit output
    tiny = nn.Sequential(nn.Linear(3, 5), nn.ReLU(), nn.Linear(5, 2))
    batch = torch.randn(10, 3)
    with torch.no_grad():
        whole = tiny(batch)
        with withheld(split, gather):
            pieces = gather_rows([tiny(part) for part in split_rows(batch, 4)])
    _require(pieces.shape == whole.shape and torch.allclose(pieces, whole, atol=1e-6),
             "running a model on each micro-batch and gathering the outputs must give the "
             "unsplit batch's output; it does not")


class _Watched(nn.Module):
    """A model that writes down each forward (its rows) and each backward that reaches its
    output, in order: how the learner's code used it, not only what it returned."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model, self.log = model, []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = len(x)
        self.log.append(("forward", rows))
        out = self.model(x)
        if out.requires_grad:
            out.register_hook(lambda grad: self.log.append(("backward", rows)))
        return out


def check_accumulate(accumulate_gradients: Callable, namespace: Namespace = None) -> None:
    """Exercise 1.2: the loss and gradients of the unsplit batch, reached by one forward
    and one backward per micro-batch, each backward before the next forward. `split` stays
    available (the exercise uses it); `loss_weights`, the weights asked for, is withheld."""
    for rows, m in [(10, 2), (10, 4), (7, 3), (10, 10)]:
        torch.manual_seed(0)
        tiny = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2))
        unsplit = copy.deepcopy(tiny)
        batch, target = torch.randn(rows, 3), torch.randn(rows, 2)
        expected = nn.functional.mse_loss(unsplit(batch), target)
        expected.backward()
        sizes = [len(c) for c in split(batch, m)]
        where = f"{rows} rows in {m} micro-batches of {sizes} rows"
        watched = _Watched(tiny)
        with withheld(loss_weights):
            loss = accumulate_gradients(watched, batch, target, m)
        forwards = [n for what, n in watched.log if what == "forward"]
        _require(forwards == sizes,
                 f"{where}: your code ran the model on {forwards} rows; run it once per "
                 f"micro-batch of split(x, m), on {sizes} rows, so that only one "
                 f"micro-batch's activations are held at a time")
        steps = [entry for n in sizes for entry in (("forward", n), ("backward", n))]
        _require(watched.log == steps,
                 f"{where}: the model's forwards and backwards ran in the order "
                 f"{[what for what, _ in watched.log]}; run each micro-batch's backward "
                 f"before the next micro-batch's forward (that is what frees its activations)")
        _require(isinstance(loss, torch.Tensor) and loss.numel() == 1,
                 f"return the batch's loss as a one-element tensor, got {loss!r}")
        _require(not loss.requires_grad, "return the loss detached (`.detach()`): the "
                                         "caller does not backpropagate it again")
        _require(torch.allclose(loss, expected, rtol=1e-5),
                 f"{where}: your loss is {loss.item():.5f}, the unsplit batch's "
                 f"{expected.item():.5f}; the batch's mean is each micro-batch's mean loss "
                 f"weighted by its share of the rows")
        for (name, p), q in zip(tiny.named_parameters(), unsplit.parameters()):
            _require(p.grad is not None, f"{where}: parameter {name} got no gradient; call "
                                         f"backward() on each micro-batch's loss")
            _require(torch.allclose(p.grad, q.grad, rtol=1e-4, atol=1e-6),
                     f"{where}: the gradient of {name} differs from the unsplit batch's (by "
                     f"up to {(p.grad - q.grad).abs().max().item():.2g}); scale each "
                     f"micro-batch's loss before its backward, so the gradients add up to "
                     f"the batch's")


FEWEST_CASES = [(4, Fraction(2, 5)), (8, Fraction(3, 10)), (4, Fraction(1, 5)),
                (3, Fraction(2, 7)), (2, Fraction(1, 2)), (6, Fraction(1, 3))]


def check_bubble_formulas(naive_utilisation: Callable, fewest_microbatches: Callable,
                          namespace: Namespace = None) -> None:
    """Exercise 1.3: against the simulator, at targets that are not 1/k (where rounding
    down and rounding up part ways: p = 4 at 2/5 needs 5, not 4)."""
    expected = {p: 1 - simulate(gpipe(p, 1)).bubble_fraction() for p in range(1, 9)}
    library = (simulate, bubble_theory)
    for p, simulated in expected.items():
        with withheld(*library):
            mine = naive_utilisation(p)
        _require(isinstance(mine, (int, float)) and abs(mine - simulated) < 1e-9,
                 f"naive_utilisation({p}) = {mine!r}, but in the simulated naive step each "
                 f"device computes {simulated:.3f} of the time (utilisation, not idle time)")
    for p, target in FEWEST_CASES:
        with withheld(*library):
            m = fewest_microbatches(p, target)
        _require(isinstance(m, int) and m >= 1,
                 f"fewest_microbatches({p}, {target}) must be a whole number >= 1, got {m!r}")
        bubble = simulate(gpipe(p, m)).bubble_fraction()
        _require(bubble <= target + 1e-9,
                 f"fewest_microbatches({p}, {target}) = {m}, but GPipe's simulated bubble at "
                 f"p = {p}, m = {m} is {bubble:.4f}, above {float(target):.4f}: too few")
        fewer = simulate(gpipe(p, m - 1)).bubble_fraction() if m > 1 else 1.0
        _require(fewer > target + 1e-9,
                 f"fewest_microbatches({p}, {target}) = {m}, but m = {m - 1} already gives "
                 f"a bubble of {fewer:.4f} <= {float(target):.4f}: it is not the fewest")


STEP_CASES = [([1.0, 3.0, 1.0], [5.0, 2.0, 2.0], 4), ([2.0, 1.0], [2.0, 4.0], 3),
              ([1.0, 2.0, 1.0, 1.0], [2.0, 2.0, 4.0, 2.0], 5), ([1.0, 1.0], [2.0, 2.0], 4),
              ([3.0], [1.0], 2)]


def check_unequal_gpipe(gpipe_step_time: Callable, namespace: Namespace = None) -> None:
    """Exercise 1.4: GPipe's step on unequal stages, against the simulator run with the
    same per-stage costs; the simulator and the builders are withheld."""
    for forward, backward, m in STEP_CASES:
        expected = simulate(gpipe(len(forward), m), forward=forward,
                            backward=backward).makespan
        with withheld(simulate, gpipe, "pipeline_lib.schedules"):
            mine = gpipe_step_time(list(forward), list(backward), m)
        _require(isinstance(mine, (int, float)) and math.isfinite(mine),
                 f"gpipe_step_time must return a number, got {mine!r}")
        _require(abs(mine - expected) < 1e-9,
                 f"forward costs {forward}, backward costs {backward} per stage, m = {m}: "
                 f"your step takes {mine:g}, GPipe's takes {expected:g}. An action starts "
                 f"when its rank is free and its input has arrived: write down when each "
                 f"one ends, stage by stage")

