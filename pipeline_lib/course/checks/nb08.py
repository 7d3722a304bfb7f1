"""Checks of notebook 08's exercises (three dimensions).

* **8.1** (a row-parallel layer's backward, by hand): the learner's
  ``row_parallel_backward`` gets each rank's part of a row-parallel linear layer and the
  output's gradient, and returns each rank's input and weight gradients and the bias's;
  they are compared with autograd on the unsplit layer, computed before. Judged on cases
  drawn here (the notebook shows none of them): several t, shapes and bias on or off.
  PyTorch's autograd is withheld while the learner's function runs: it would differentiate
  the layer instead of the learner.
* **8.2** (the process groups of a ``t × p × d`` mesh): the learner's ``mesh_groups``
  gets a rank order and the sizes, and returns every dimension's groups; compared with
  `parallel.rank_order.groups` (withheld while the learner's function runs) on orders and
  sizes drawn here, including orders and sizes the notebook never uses.

A wrong answer's message says what is wrong for one rank or one tensor, with what it
should have been, never the whole expected answer.
"""
from __future__ import annotations

import contextlib
import math
import random
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

import torch
from torch import Tensor
from torch.nn import functional as F

from pipeline_lib.course.exercises import ExerciseFailed, withheld
from pipeline_lib.parallel import rank_order

__all__ = ["check_8_1", "check_8_2", "row_parallel_cases", "mesh_cases"]


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ExerciseFailed(message)


# -- 8.1: a row-parallel linear layer's backward -------------------------------------------

RowCase = tuple[list[Tensor], list[Tensor], Tensor | None, Tensor]


def row_parallel_cases() -> list[tuple[str, RowCase]]:
    """(description, (x_parts, weight_parts, bias, grad_out)): t = 2, 3 and 4 ranks,
    float64, one case without a bias; drawn with a fixed seed, not shown in the notebook."""
    g = torch.Generator().manual_seed(808)
    cases = []
    for t, rows, inputs, outputs, bias in ((2, 5, 6, 4, True), (3, 7, 9, 5, True),
                                           (4, 3, 8, 6, False)):
        def rand(*shape: int) -> Tensor:
            return torch.randn(*shape, generator=g, dtype=torch.float64)

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


@contextlib.contextmanager
def _autograd_withheld(namespace: dict[str, Any] | None) -> Iterator[None]:
    """``torch.autograd.grad`` and ``backward`` (``Tensor.backward`` calls the latter)
    refuse to run in the block: they would differentiate the layer for the learner."""
    def refusal(name: str) -> Callable[..., Any]:
        def refuse(*args: Any, **kwargs: Any) -> Any:
            raise ExerciseFailed(f"your code calls torch.autograd ({name}), which would "
                                 f"differentiate the layer for you: write each gradient "
                                 f"as a product of the tensors you are given")
        return refuse

    with contextlib.ExitStack() as stack:
        stack.enter_context(withheld(torch.autograd.grad, torch.autograd.backward,
                                     namespace=namespace))
        for name in ("grad", "backward"):
            stack.enter_context(mock.patch.object(torch.autograd, name, refusal(name)))
        yield


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


def check_8_1(row_parallel_backward: Callable[..., Any],
              namespace: dict[str, Any] | None = None) -> None:
    """Exercise 8.1 (see the module docstring)."""
    for name, case in row_parallel_cases():
        want_x, want_w, want_b = _expected(case)
        x_parts, weight_parts, bias, grad_out = case
        t = len(x_parts)
        with _autograd_withheld(namespace):
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

def mesh_cases() -> list[tuple[str, dict[str, int]]]:
    """(order, sizes): Megatron-LM's and Llama 3's orders and two others, on sizes where
    no two dimensions are equal, and a mesh with a dimension of size 1; drawn with a
    fixed seed, not shown in the notebook."""
    rng = random.Random(808)
    orders = [rank_order.MEGATRON, rank_order.LLAMA3, "pp-tp-dp", "dp-pp-tp"]
    cases = []
    for order in orders:
        sizes = dict(zip(("tp", "pp", "dp"), rng.sample([2, 3, 4], 3)))
        cases.append((order, sizes))
    cases.append(("tp-dp-pp", {"tp": 4, "pp": 1, "dp": 2}))
    return cases


def _where(rank: int, order: str, sizes: dict[str, int]) -> str:
    coords = rank_order.coordinates(rank, order, sizes)
    return ", ".join(f"{d} {coords[d]}" for d in ("tp", "pp", "dp"))


def check_8_2(mesh_groups: Callable[[str, dict[str, int]], Any],
              namespace: dict[str, Any] | None = None) -> None:
    """Exercise 8.2 (see the module docstring)."""
    for order, sizes in mesh_cases():
        want = {dim: rank_order.groups(dim, order, sizes) for dim in sizes}
        with withheld("pipeline_lib.parallel.rank_order", namespace=namespace):
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
                group = mine.get(rank)
                _require(group == right,
                         f"{case}: rank {rank} (at {_where(rank, order, sizes)}) is in "
                         f"{dim} group {group}, which should hold the {sizes[dim]} ranks "
                         f"that share its other coordinates, in order of their {dim} "
                         f"coordinate: {right}. The order lists the dimension whose "
                         f"coordinate changes fastest first")
            _require(groups == sorted(groups),
                     f"{case}: list the {dim} groups in order of their first rank")
