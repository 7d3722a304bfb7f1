"""Checks of notebook 01's exercises (naive model parallelism and GPipe).

Each ``check_*`` takes the learner's functions, runs them where the library functions that
*are* the answer are withheld (`withheld`: however the learner reached them), on the
notebook's cases and on cases drawn afresh for every run (`hidden_cases`), and raises
`ExerciseFailed` with what is wrong, never with the expected answer itself. Where the
result alone cannot tell a wrong method from the right one (a whole-batch backward gives
the right gradients too), the check watches *how* the answer works.
"""
from __future__ import annotations

import copy
import math
import numbers
from collections.abc import Callable
from fractions import Fraction
from typing import Any

import torch
from torch import nn

from pipeline_lib.course.exercises import (ExerciseFailed, hidden_cases, ignores_namespace,
                                           withheld)
from pipeline_lib.microbatch import gather, loss_weights, split
from pipeline_lib.schedules import execution_order, gpipe
from pipeline_lib.timeline import _simulate, bubble_theory, simulate


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ExerciseFailed(message)


def _sizes_problem(sizes: list[int], rows: int, m: int) -> str:
    """Why micro-batch ``sizes`` are not `split`'s for ``rows`` rows in ``m``, without
    saying what they should be."""
    if sum(sizes) != rows:
        return f"they hold {sum(sizes)} rows in all, not {rows}: every row goes once"
    if max(sizes) - min(sizes) > 1:
        return "they differ by more than one row: make them as equal as possible"
    return "the larger micro-batches come first"


@ignores_namespace(2)
def check_split_and_gather(split_rows: Callable, gather_rows: Callable) -> None:
    """Exercise 1.1: sizes and rows against the library's `split` and `gather`, computed
    before the learner's code runs with both withheld, on the notebook's cases and on
    sizes drawn for this run; the micro-batches and the joined batch stay connected to
    autograd (a copy made with ``torch.tensor`` or ``.detach()`` cuts the backward off)."""
    shown = [(8, 4), (10, 4), (7, 7), (5, 1), (11, 3)]
    drawn = hidden_cases(lambda rng: (rows := rng.randint(2, 60), rng.randint(1, min(rows, 12))),
                         4, shown=shown)
    for rows, m in shown + drawn:
        batch = torch.arange(rows * 3, dtype=torch.float32).reshape(rows, 3).requires_grad_()
        library = [part.detach() for part in split(batch, m)]
        expected = [len(c) for c in library]
        with withheld(split, gather):
            mine = split_rows(batch, m)
        case = f"split_rows(a batch of {rows} rows, {m})"
        _require(isinstance(mine, (list, tuple)) and len(mine) == m
                 and all(isinstance(c, torch.Tensor) for c in mine),
                 f"{case} must return a list of {m} tensors, got {mine!r}"[:300])
        sizes = [len(c) for c in mine]
        _require(sizes == expected,
                 f"{case} gives micro-batches of {sizes} rows: {_sizes_problem(sizes, rows, m)}")
        _require(all(torch.equal(a, b) for a, b in zip(mine, library)),
                 f"{case}: the sizes are right but the rows are not: micro-batch k must hold "
                 f"the next rows of the batch, in order")
        weights = torch.randn(rows, 3)
        _require(all(c.requires_grad for c in mine),
                 f"{case}: a micro-batch is cut off from the batch's graph (requires_grad is "
                 f"False): the backward could not reach the layers before the pipeline. Take "
                 f"slices of the batch (indexing, torch.split, narrow), or clones autograd "
                 f"links to it (.clone()), not copies of its values (torch.tensor(...), "
                 f".detach(), numpy)")
        sum((c * w).sum() for c, w in zip(mine, weights.split(sizes))).backward()
        _require(batch.grad is not None and torch.equal(batch.grad, weights),
                 f"{case}: the gradient of the micro-batches does not reach each row of the "
                 f"batch once: make every micro-batch from its own rows of the batch, linked "
                 f"to it by autograd")
        pieces = [part.clone().requires_grad_() for part in library]
        with withheld(split, gather):
            joined = gather_rows(list(pieces))
        _require(isinstance(joined, torch.Tensor) and joined.shape == batch.shape
                 and torch.equal(joined.detach(), batch.detach()),
                 f"gather_rows of {m} micro-batches of {rows} rows does not give back the "
                 f"batch, in order: join them along dim 0")
        _require(joined.requires_grad,
                 f"gather_rows of {m} micro-batches: the result is cut off from the "
                 f"micro-batches' graph (requires_grad is False), so no gradient would reach "
                 f"the stages: join the tensors themselves (torch.cat), not copies of their "
                 f"values")
        (joined * weights).sum().backward()
        _require(all(p.grad is not None and torch.equal(p.grad, w)
                     for p, w in zip(pieces, weights.split(expected))),
                 f"gather_rows of {m} micro-batches: the joined batch's gradient does not "
                 f"reach each micro-batch's rows once, in order")
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


@ignores_namespace(1)
def check_accumulate(accumulate_gradients: Callable) -> None:
    """Exercise 1.2: the loss and gradients of the unsplit batch, reached by one forward
    and one backward per micro-batch, each backward before the next forward, on the
    notebook's cases and on sizes drawn for this run. `split` stays available (the
    exercise uses it); `loss_weights`, the weights asked for, is withheld."""
    shown = [(10, 2), (10, 4), (7, 3), (10, 10)]
    drawn = hidden_cases(lambda rng: (rows := rng.randint(3, 40), rng.randint(2, min(rows, 9))),
                         3, shown=shown)
    for rows, m in shown + drawn:
        torch.manual_seed(rows * 100 + m)
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
                 f"{where}: your loss is {loss.item():.5f}, {loss.item() / expected.item():.3g} "
                 f"times the unsplit batch's; the batch's mean is each micro-batch's mean "
                 f"loss weighted by its share of the rows")
        for (name, p), q in zip(tiny.named_parameters(), unsplit.parameters()):
            _require(p.grad is not None, f"{where}: parameter {name} got no gradient; call "
                                         f"backward() on each micro-batch's loss")
            _require(torch.allclose(p.grad, q.grad, rtol=1e-4, atol=1e-6),
                     f"{where}: the gradient of {name} differs from the unsplit batch's (by "
                     f"up to {(p.grad - q.grad).abs().max().item():.2g}); scale each "
                     f"micro-batch's loss before its backward, so the gradients add up to "
                     f"the batch's")


FEWEST_CASES = [(4, Fraction(2, 5)), (8, Fraction(3, 10)), (4, Fraction(1, 5)),
                (3, Fraction(2, 7)), (2, Fraction(1, 2)), (6, Fraction(1, 3)),
                (1, Fraction(1, 10))]


#: The simulator, with what it runs on: `_simulate` times the actions in the order
#: `execution_order` gives, and a learner could call the two directly.
SIMULATOR = (simulate, _simulate, execution_order)


def _gpipe_bubble(p: int, m: int) -> float:
    return simulate(gpipe(p, m)).bubble_fraction()


@ignores_namespace(2)
def check_bubble_formulas(naive_utilisation: Callable, fewest_microbatches: Callable) -> None:
    """Exercise 1.3: against the simulator, at targets that are not 1/k (where rounding
    down and rounding up part ways: p = 4 at 2/5 needs 5, not 4), and at ranks and targets
    drawn for this run. Any real number is a utilisation (a float, a `Fraction`); the
    simulator (its private engine and the order it times included) and `bubble_theory`
    are withheld while the learner's functions run."""
    library = (*SIMULATOR, bubble_theory)
    ranks = list(range(1, 9)) + hidden_cases(lambda rng: rng.randint(9, 64), 3,
                                             shown=range(1, 9))
    for p in ranks:
        simulated = 1 - _gpipe_bubble(p, 1)
        with withheld(*library):
            mine = naive_utilisation(p)
        _require(isinstance(mine, numbers.Real) and not isinstance(mine, bool),
                 f"naive_utilisation({p}) must return a number, got {mine!r}")
        if abs(mine - simulated) < 1e-9:
            continue
        idle = abs(mine - (1 - simulated)) < 1e-9
        _require(False, f"naive_utilisation({p}) = {float(mine):.4g}, not the share of the "
                        f"simulated naive step each device computes"
                 + ("; that is the share each device idles (the bubble)" if idle else ""))
    shown = [case for case in FEWEST_CASES]
    drawn = hidden_cases(lambda rng: (rng.randint(1, 16),
                                      Fraction(rng.randint(1, 9), rng.randint(10, 40))),
                         4, shown=shown)
    for p, target in shown + drawn:
        with withheld(*library):
            m = fewest_microbatches(p, target)
        _require(isinstance(m, numbers.Integral) and not isinstance(m, bool) and m >= 1,
                 f"fewest_microbatches({p}, {target}) must be a whole number >= 1, got {m!r}")
        bubble = _gpipe_bubble(p, m)
        _require(bubble <= target + 1e-9,
                 f"fewest_microbatches({p}, {target}) = {m}, but GPipe's simulated bubble at "
                 f"p = {p}, m = {m} is {bubble:.4f}, above {float(target):.4f}: too few")
        fewer = _gpipe_bubble(p, m - 1) if m > 1 else 1.0
        _require(fewer > target + 1e-9,
                 f"fewest_microbatches({p}, {target}) = {m}, but fewer micro-batches already "
                 f"keep the bubble at most {float(target):.4f}: it is not the fewest")


STEP_CASES = [([1.0, 3.0, 1.0], [5.0, 2.0, 2.0], 4), ([2.0, 1.0], [2.0, 4.0], 3),
              ([1.0, 2.0, 1.0, 1.0], [2.0, 2.0, 4.0, 2.0], 5), ([1.0, 1.0], [2.0, 2.0], 4),
              ([3.0], [1.0], 2)]


def _pipeline(rng: Any) -> tuple[tuple[float, ...], tuple[float, ...], int]:
    p = rng.randint(2, 5)
    return (tuple(float(rng.randint(1, 6)) for _ in range(p)),
            tuple(float(rng.randint(1, 8)) for _ in range(p)), rng.randint(1, 7))


@ignores_namespace(1)
def check_unequal_gpipe(gpipe_step_time: Callable) -> None:
    """Exercise 1.4: GPipe's step on unequal stages, against the simulator run with the
    same per-stage costs, on the notebook's pipelines and on costs drawn for this run;
    the simulator and the builders are withheld."""
    shown = [(tuple(f), tuple(b), m) for f, b, m in STEP_CASES]
    for forward, backward, m in shown + hidden_cases(_pipeline, 5, shown=shown):
        expected = simulate(gpipe(len(forward), m), forward=list(forward),
                            backward=list(backward)).makespan
        with withheld(*SIMULATOR, gpipe, "pipeline_lib.schedules"):
            mine = gpipe_step_time(list(forward), list(backward), m)
        _require(isinstance(mine, numbers.Real) and math.isfinite(mine),
                 f"gpipe_step_time must return a number, got {mine!r}")
        _require(abs(mine - expected) < 1e-9,
                 f"forward costs {list(forward)}, backward costs {list(backward)} per stage, "
                 f"m = {m}: your step takes {float(mine):g}, GPipe's takes "
                 f"{'longer' if expected > mine else 'less'}. An action starts when its rank "
                 f"is free and its input has arrived: write down when each one ends, stage "
                 f"by stage")
