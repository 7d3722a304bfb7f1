"""Checks of notebook 08's exercises (three dimensions).

* **8.1** (a row-parallel layer's backward, by hand): the learner's
  ``row_parallel_backward`` gets each rank's part of a row-parallel linear layer and the
  output's gradient, and returns each rank's input and weight gradients and the bias's;
  they are compared with autograd on the unsplit layer, computed before. Judged on cases
  drawn afresh each run (`hidden_cases`; the notebook shows none): t = 2, 3 and 4 ranks,
  with and without a bias. PyTorch's autograd is withheld while the learner's function
  runs: it would differentiate the layer instead of the learner.
* **8.2** (the process groups of a ``t × p × d`` mesh): the learner's ``mesh_groups``
  gets a rank order and the sizes, and returns every dimension's groups; compared with
  `parallel.rank_order.groups` (withheld while the learner's function runs) on orders and
  sizes drawn afresh each run, none the notebook's example, and on a mesh with a
  dimension of size 1.

A wrong answer's message says what is wrong for one rank or one tensor, never what it
should have been.
"""
from __future__ import annotations

import math
import random
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.nn import functional as F

from pipeline_lib.course.exercises import ExerciseFailed, hidden_cases, ignores_namespace, withheld
from pipeline_lib.parallel import rank_order

__all__ = ["check_8_1", "check_8_2", "row_parallel_cases", "mesh_cases"]


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ExerciseFailed(message)


# -- 8.1: a row-parallel linear layer's backward -------------------------------------------

RowCase = tuple[list[Tensor], list[Tensor], Tensor | None, Tensor]
_AUTOGRAD = ("your code calls torch.autograd.{name}, which would differentiate the layer "
             "for you: write each gradient as a product of the tensors you are given")


def row_parallel_cases(seed: int | None = None) -> list[tuple[str, RowCase]]:
    """(description, (x_parts, weight_parts, bias, grad_out)): t = 2 and 3 ranks with a
    bias, 4 without, float64, shapes and values drawn with ``seed`` (fresh each run by
    default)."""
    def draw(rng: random.Random) -> tuple[int, int, int, int]:   # rows, width, outputs, seed
        # more outputs than a rank's inputs: a transposed weight gradient shows by its shape
        return rng.randint(2, 7), rng.randint(1, 3), rng.randint(4, 7), rng.randrange(2**31)

    rng = random.Random(seed)
    drawn = hidden_cases(draw, 3) if seed is None else [draw(rng) for _ in range(3)]
    cases = []
    for (t, bias), (rows, width, outputs, values) in zip(((2, True), (3, True), (4, False)),
                                                         drawn):
        g = torch.Generator().manual_seed(values)

        def rand(*shape: int) -> Tensor:
            return torch.randn(*shape, generator=g, dtype=torch.float64)

        inputs = t * width
        x, weight = rand(rows, inputs), rand(outputs, inputs)
        cases.append((f"t = {t}, x of {rows} × {inputs}, weight of {outputs} × {inputs}"
                      + ("" if bias else ", no bias"),
                      (list(x.chunk(t, 1)), list(weight.chunk(t, 1)),
                       rand(outputs) if bias else None, rand(rows, outputs))))
    return cases


def _expected(case: RowCase) -> tuple[list[Tensor], list[Tensor], Tensor | None]:
    x_parts, weight_parts, bias, grad_out = case
    x = torch.cat(x_parts, 1).requires_grad_()
    weight = torch.cat(weight_parts, 1).requires_grad_()
    b = bias.clone().requires_grad_() if bias is not None else None
    F.linear(x, weight, b).backward(grad_out)
    widths = [p.size(1) for p in x_parts]
    return (list(x.grad.split(widths, 1)), list(weight.grad.split(widths, 1)),
            None if b is None else b.grad)


def _compare(what: str, got: Any, want: Tensor, hint: str) -> None:
    _require(isinstance(got, Tensor), f"{what}: return a tensor, got {type(got).__name__}")
    _require(tuple(got.shape) == tuple(want.shape),
             f"{what} has shape {tuple(got.shape)}, expected {tuple(want.shape)}: {hint}")
    if torch.allclose(got.to(want.dtype), want, rtol=1e-6, atol=1e-9):
        return
    ratio = float((got.to(want.dtype) * want).sum() / (want * want).sum())
    scaled = (f" (it is {ratio:.3g} times the right one)"
              if torch.allclose(got.to(want.dtype), ratio * want, rtol=1e-6, atol=1e-9)
              else "")
    raise ExerciseFailed(f"{what} is wrong{scaled}: {hint}")


@ignores_namespace(1)
def check_8_1(row_parallel_backward: Callable[..., Any], seed: int | None = None) -> None:
    """Exercise 8.1 (see the module docstring); ``seed`` draws the cases (fresh each run
    by default)."""
    for name, case in row_parallel_cases(seed):
        want_x, want_w, want_b = _expected(case)
        x_parts, weight_parts, bias, grad_out = case
        t = len(x_parts)
        with withheld(torch.autograd.grad, torch.autograd.backward, reason=_AUTOGRAD):
            answer = row_parallel_backward([p.clone() for p in x_parts],
                                           [p.clone() for p in weight_parts],
                                           None if bias is None else bias.clone(),
                                           grad_out.clone())
        _require(isinstance(answer, (tuple, list)) and len(answer) == 3,
                 f"{name}: return (grad_x_parts, grad_weight_parts, grad_bias), got "
                 f"{type(answer).__name__}")
        grad_x, grad_w, grad_b = answer
        _require(isinstance(grad_x, (list, tuple)) and len(grad_x) == t
                 and isinstance(grad_w, (list, tuple)) and len(grad_w) == t,
                 f"{name}: return one input gradient and one weight gradient per rank "
                 f"({t} each)")
        for r in range(t):
            _compare(f"{name}: rank {r}'s input gradient", grad_x[r], want_x[r],
                     "every rank receives the whole output gradient (g's backward is the "
                     "identity) and multiplies it by its own columns of the weight")
            _compare(f"{name}: rank {r}'s weight gradient", grad_w[r], want_w[r],
                     "the output gradient (transposed) times this rank's own input "
                     "columns; shaped like this rank's weight part")
        if want_b is None:
            _require(grad_b is None, f"{name}: the layer has no bias; return None for it")
        else:
            _compare(f"{name}: the bias gradient", grad_b, want_b,
                     "the bias is added once, after the sum over the ranks: its gradient "
                     "is the output gradient summed over the rows, whole on every rank")


# -- 8.2: the process groups of a t × p × d mesh -------------------------------------------

def mesh_cases(seed: int | None = None) -> list[tuple[str, dict[str, int]]]:
    """(order, sizes): four orders of tp, pp and dp with sizes from 1 to 4, at most one of
    them 1 and no two equal (so that a dimension's stride cannot be taken for its size),
    none the notebook's example (every size 2), drawn with ``seed`` (fresh each run by
    default); and one mesh with a dimension of size 1."""
    def draw(rng: random.Random) -> tuple[str, tuple[int, int, int]]:
        order = "-".join(rng.sample(("tp", "pp", "dp"), 3))
        return order, tuple(rng.sample([2, 3, 4], 3) if rng.random() < 0.75
                            else rng.sample([1, 2, 3, 4], 3))

    rng = random.Random(seed)
    drawn = (hidden_cases(draw, 4, shown=[(rank_order.MEGATRON, (2, 2, 2))]) if seed is None
             else [draw(rng) for _ in range(4)])
    cases = [(order, dict(zip(("tp", "pp", "dp"), sizes))) for order, sizes in drawn]
    return cases + [(rank_order.MEGATRON, {"tp": 4, "pp": 1, "dp": 2})]


def _where(rank: int, order: str, sizes: dict[str, int]) -> str:
    coords = rank_order.coordinates(rank, order, sizes)
    return ", ".join(f"{d} {coords[d]}" for d in ("tp", "pp", "dp"))


def _what_is_off(rank: int, group: list[int] | None, dim: str, order: str,
                 sizes: dict[str, int]) -> str:
    """Why ``group``, the learner's ``dim`` group holding ``rank``, is wrong, without
    saying the right one."""
    if group is None:
        return f"rank {rank} is in none of your {dim} groups"
    mine = rank_order.coordinates(rank, order, sizes)
    for other in group:
        if not 0 <= other < math.prod(sizes.values()):
            return f"your {dim} group {group} holds {other}, which is not a rank"
        theirs = rank_order.coordinates(other, order, sizes)
        differ = [d for d in sizes if d != dim and theirs[d] != mine[d]]
        if differ:
            return (f"your {dim} group {group} puts rank {rank} (at "
                    f"{_where(rank, order, sizes)}) with rank {other} (at "
                    f"{_where(other, order, sizes)}): they differ in {differ[0]}, and a "
                    f"{dim} group's ranks share every coordinate but {dim}")
    return (f"your {dim} group {group}, holding rank {rank}, lists its ranks out of the "
            f"order of their {dim} coordinates (from 0 up)")


@ignores_namespace(1)
def check_8_2(mesh_groups: Callable[[str, dict[str, int]], Any],
              seed: int | None = None) -> None:
    """Exercise 8.2 (see the module docstring); ``seed`` draws the cases (fresh each run
    by default)."""
    for order, sizes in mesh_cases(seed):
        want = {dim: rank_order.groups(dim, order, sizes) for dim in sizes}
        with withheld("pipeline_lib.parallel.rank_order"):
            got = mesh_groups(order, dict(sizes))
        case = f"order {order!r} with {sizes}"
        _require(isinstance(got, dict) and sorted(got) == sorted(sizes),
                 f"{case}: return a dict with one entry per dimension, {sorted(sizes)}; "
                 f"got {got!r:.200}")
        world = math.prod(sizes.values())
        for dim in ("tp", "pp", "dp"):
            try:
                groups = [[int(r) for r in g] for g in got[dim]]
            except (TypeError, ValueError):
                raise ExerciseFailed(f"{case}: {dim} must be a list of groups, each a list "
                                     f"of ranks; got {got[dim]!r:.200}") from None
            _require(len(groups) == world // sizes[dim]
                     and all(len(g) == sizes[dim] for g in groups),
                     f"{case}: {world} ranks make {world // sizes[dim]} {dim} groups of "
                     f"{sizes[dim]}; you returned {len(groups)} groups of sizes "
                     f"{sorted({len(g) for g in groups})}")
            mine = {r: g for g in groups for r in g}
            for rank, right in ((r, g) for g in want[dim] for r in g):
                _require(mine.get(rank) == right,
                         f"{case}: {_what_is_off(rank, mine.get(rank), dim, order, sizes)}. "
                         f"The order lists the dimension whose coordinate changes fastest "
                         f"first")
            _require(groups == sorted(groups),
                     f"{case}: list the {dim} groups in order of their first rank")
