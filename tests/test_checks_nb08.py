"""Notebook 08's exercise checks, in-process: each solution passes; each plausible wrong
answer, and each shortcut through a library that computes the answer, fails with its
exercise's message."""
from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from conftest import fails, passes
from pipeline_lib.course.checks.nb08 import check_8_1, check_8_2, mesh_cases
from pipeline_lib.parallel import rank_order

E81 = "Exercise 8.1 (a row-parallel layer's backward)"
E82 = "Exercise 8.2 (the process groups of a t × p × d mesh)"


# -- 8.1 ----------------------------------------------------------------------------------------

def backward(x_parts, weight_parts, bias, grad_out, *, summed=False, shares=False,
             transposed=False, whole_weight=False, bias_split=False):
    """The solution (defaults) and the usual slips: the output gradient all-reduced as if
    g's backward were f's (t times too large), each rank's input gradient divided by t,
    the weight gradient transposed, the input gradient from the whole weight, the bias's
    gradient split over the ranks."""
    t = len(x_parts)
    grad = grad_out * t if summed else grad_out
    weight = torch.cat(weight_parts, 1)
    grad_x = [(grad @ (weight if whole_weight else w)) / (t if shares else 1)
              for w in weight_parts]
    grad_w = [(x.T @ grad) if transposed else (grad.T @ x) for x in x_parts]
    grad_b = None if bias is None else grad.sum(0) / (t if bias_split else 1)
    return grad_x, grad_w, grad_b


def test_8_1_solution_passes():
    passes(E81, check_8_1, backward)


@pytest.mark.parametrize("slip, says", [
    ("summed", "times the right one"),
    ("shares", "input gradient is wrong"),
    ("transposed", "weight gradient has shape"),
    ("whole_weight", "input gradient has shape"),
    ("bias_split", "bias gradient is wrong"),
])
def test_8_1_wrong_answers_fail(slip, says):
    fails(E81, check_8_1, lambda *case: backward(*case, **{slip: True}), says=says)


def test_8_1_fails_on_no_bias_answer_and_shapes():
    fails(E81, check_8_1, lambda *case: backward(*case)[:2], says="return (grad_x_parts")
    fails(E81, check_8_1,
          lambda x, w, b, g: (*backward(x, w, b, g)[:2], torch.zeros(1)),
          says="bias gradient")


def test_8_1_autograd_is_withheld():
    def by_autograd(x_parts, weight_parts, bias, grad_out):
        xs = [x.clone().requires_grad_() for x in x_parts]
        ws = [w.clone().requires_grad_() for w in weight_parts]
        b = None if bias is None else bias.clone().requires_grad_()
        out = sum(F.linear(x, w) for x, w in zip(xs, ws)) + (0 if b is None else b)
        out.backward(grad_out)
        return [x.grad for x in xs], [w.grad for w in ws], None if b is None else b.grad

    def by_grad(x_parts, weight_parts, bias, grad_out):
        xs = [x.clone().requires_grad_() for x in x_parts]
        out = sum(F.linear(x, w) for x, w in zip(xs, weight_parts))
        return torch.autograd.grad(out, xs, grad_out), None, None

    for shortcut in (by_autograd, by_grad):
        fails(E81, check_8_1, shortcut, says="torch.autograd")


# -- 8.2 ----------------------------------------------------------------------------------------

def groups(order, sizes, *, reversed_order=False, own_stride=False, consecutive=False,
           descending=False, unsorted=False):
    """The solution (defaults) and the usual slips: the order read slowest first (as a
    DeviceMesh's shape is written), a dimension's stride taken as its own size, every
    dimension's groups as consecutive ranks, a group's ranks in reverse, the groups in
    another order."""
    dims = order.split("-")[::-1] if reversed_order else order.split("-")
    world = 1
    for n in sizes.values():
        world *= n
    strides, stride = {}, 1
    for d in dims:
        strides[d] = sizes[d] if own_stride else stride
        stride *= sizes[d]

    def coords(rank):
        out = {}
        for d in dims:
            rank, out[d] = divmod(rank, sizes[d])
        return out

    result = {}
    for dim in sizes:
        if consecutive:
            found = [list(range(s, s + sizes[dim])) for s in range(0, world, sizes[dim])]
        else:
            found, seen = [], set()
            for rank in range(world):
                if rank in seen:
                    continue
                base = rank - coords(rank)[dim] * strides[dim]
                group = [base + k * strides[dim] for k in range(sizes[dim])]
                seen.update(group)
                found.append(group[::-1] if descending else group)
        result[dim] = found[::-1] if unsorted else found
    return result


def test_8_2_solution_passes():
    passes(E82, check_8_2, groups)


FASTEST = "The order lists the dimension whose coordinate changes fastest first"


@pytest.mark.parametrize("slip, says", [
    ("reversed_order", FASTEST),
    ("own_stride", "ranks make"),
    ("consecutive", FASTEST),
    ("descending", "out of the order of their"),
    ("unsorted", "in order of their first rank"),
])
def test_8_2_wrong_answers_fail(slip, says):
    fails(E82, check_8_2, lambda order, sizes: groups(order, sizes, **{slip: True}), says=says)


@pytest.mark.parametrize("seed", range(5))
def test_8_2_says_what_is_wrong_without_the_right_groups(seed):
    message = fails(E82, check_8_2, lambda order, sizes: groups(order, sizes,
                                                               reversed_order=True), seed)
    order, sizes = next((o, s) for o, s in mesh_cases(seed) if f"order {o!r} with {s}" in message)
    for dim in sizes:
        assert all(str(g) not in message for g in rank_order.groups(dim, order, sizes)
                   if len(g) > 1), message


def test_8_2_the_library_is_withheld():
    def by_library(order, sizes):
        return {d: rank_order.groups(d, order, sizes) for d in sizes}

    fails(E82, check_8_2, by_library, says="computes the very answer")


def test_8_2_wrong_shapes_fail():
    fails(E82, check_8_2, lambda order, sizes: {"tp": []}, says="one entry per dimension")
    fails(E82, check_8_2, lambda order, sizes: {d: [[0]] for d in sizes}, says="groups of")
