"""Notebook 02b's exercise checks: the solution passes; plausible wrong answers, and the
library function that is the answer, each fail with the exercise's own message."""
from __future__ import annotations


import pytest
import torch

from pipeline_lib.course.checks import nb02b
from pipeline_lib.schedules import Schedule, build, one_forward_one_backward, zb_h1
from pipeline_lib.split_backward import backward_input
from pipeline_lib.timeline import rank_facts, simulate
from conftest import fails, passes

EX_1 = "Exercise 2b.1 (ZB-H1's bubble at any costs)"
EX_2 = "Exercise 2b.2 (ZB-H1 from 1F1B's building block)"
EX_3 = "Exercise 2b.3 (I and W by hand)"




# 2b.1 --------------------------------------------------------------------------------
def zb_h1_bubble(p, f, i, w):
    return (p - 1) * max(f + i - w, f, i)


def test_2b_1_solution_passes():
    passes(EX_1, nb02b.check_zb_h1_bubble, zb_h1_bubble)


@pytest.mark.parametrize("answer, says", [
    (lambda p, f, i, w: (p - 1) * (f + i - w), "the published formula"),   # DeepSeek's, 02's
    (lambda p, f, i, w: (p - 1) * (f + i + w), "1F1B's bubble"),
    (lambda p, f, i, w: (p - 1) * f, "your formula gives"),
    (lambda p, f, i, w: (p - 1) * max(f + i - w, f), "your formula gives"),
    (lambda p, f, i, w: (p - 1) * max(f + i - w, 0), "your formula gives"),
    (lambda p, f, i, w: (p - 1) * max(f + i - w, f, i, w), "your formula gives"),  # W waits
])
def test_2b_1_wrong_answers_fail(answer, says):
    fails(EX_1, nb02b.check_zb_h1_bubble, answer, says=says)


def test_2b_1_library_shortcut_fails():
    def by_simulating(p, f, i, w):
        s = zb_h1(p, 3 * p)
        return max(r.bubble for r in rank_facts(s, simulate(s, forward=f, backward=i + w,
                                                            weight=w)))
    fails(EX_1, nb02b.check_zb_h1_bubble, by_simulating, globals(), says="your code calls")


# 2b.2 --------------------------------------------------------------------------------
def my_zb_h1(p, m, ahead=lambda p, s: p - s, lag=lambda p, s: s):
    mine = [[(s, i) for i in range(m)] for s in range(p)]
    return Schedule("my ZB-H1", p, m, [one_forward_one_backward(
        mine[s], mine[s], ahead=ahead(p, s), weight_lag=lag(p, s)) for s in range(p)])


def test_2b_2_solution_passes():
    passes(EX_2, nb02b.check_my_zb_h1, my_zb_h1)


@pytest.mark.parametrize("answer, says", [
    (lambda p, m: my_zb_h1(p, m, lag=lambda p, s: None), "split every backward"),
    (lambda p, m: my_zb_h1(p, m, lag=lambda p, s: 0), "weight lag"),
    (lambda p, m: my_zb_h1(p, m, lag=lambda p, s: p - 1 - s), "a rank holds"),
    (lambda p, m: my_zb_h1(p, m, ahead=lambda p, s: p), "a rank holds"),
])
def test_2b_2_wrong_answers_fail(answer, says):
    fails(EX_2, nb02b.check_my_zb_h1, answer, says=says)


@pytest.mark.parametrize("answer", [lambda p, m: zb_h1(p, m), lambda p, m: build("zb_h1", p, m)])
def test_2b_2_library_shortcut_fails(answer):
    fails(EX_2, nb02b.check_my_zb_h1, answer, globals(), says="your code calls")


# 2b.3 --------------------------------------------------------------------------------
def input_then_weight(stage, x, g):
    x = x.detach().requires_grad_()
    y = stage(x)
    (grad_x,) = torch.autograd.grad(y, [x], g, retain_graph=True)
    return grad_x, list(torch.autograd.grad(y, list(stage.parameters()), g))


def both_at_once(stage, x, g):
    x = x.detach().requires_grad_()
    grads = torch.autograd.grad(stage(x), [x, *stage.parameters()], g)
    return grads[0], list(grads[1:])


def weight_first(stage, x, g):
    x = x.detach().requires_grad_()
    y = stage(x)
    grad_w = torch.autograd.grad(y, list(stage.parameters()), g, retain_graph=True)
    return torch.autograd.grad(y, [x], g)[0], list(grad_w)


def forward_again(stage, x, g):
    x = x.detach().requires_grad_()
    (grad_x,) = torch.autograd.grad(stage(x), [x], g)
    return grad_x, list(torch.autograd.grad(stage(x), list(stage.parameters()), g))


def graph_not_kept(stage, x, g):
    x = x.detach().requires_grad_()
    y = stage(x)
    (grad_x,) = torch.autograd.grad(y, [x], g)
    return grad_x, list(torch.autograd.grad(y, list(stage.parameters()), g))


def with_backward(stage, x, g):
    x = x.detach().requires_grad_()
    stage(x).backward(g)
    return x.grad, [p.grad for p in stage.parameters()]


def test_2b_3_solution_passes():
    passes(EX_3, nb02b.check_input_then_weight, input_then_weight)


@pytest.mark.parametrize("answer, says", [
    (both_at_once, "called torch.autograd.grad 1 time"),
    (weight_first, "asks for weight gradients"),
    (forward_again, "forward 2 times"),
    (graph_not_kept, "RuntimeError"),
    (with_backward, "`.grad` is filled"),
])
def test_2b_3_wrong_answers_fail(answer, says):
    fails(EX_3, nb02b.check_input_then_weight, answer, says=says)


def test_2b_3_library_shortcut_fails():
    def split_by_the_library(stage, x, g):
        x = x.detach().requires_grad_()
        (grad_x,), later = backward_input([stage(x)], [g], [x], list(stage.parameters()))
        later.run()
        return grad_x, [p.grad for p in stage.parameters()]
    fails(EX_3, nb02b.check_input_then_weight, split_by_the_library, globals(),
          says="your code calls `backward_input`")
