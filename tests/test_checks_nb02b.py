"""Notebook 02b's exercise checks: the solution passes; plausible wrong answers, and the
library function that is the answer, each fail with the exercise's own message."""
from __future__ import annotations

import re

import pytest
import torch

from pipeline_lib.course.checks import nb02b
from pipeline_lib.schedules import (BUILDERS, Schedule, build, execution_order,
                                    one_forward_one_backward, zb_h1)
from pipeline_lib.split_backward import backward_input
from pipeline_lib.timeline import _simulate, rank_facts, simulate
from conftest import fails, passes
from copies import copied

EX_1 = "Exercise 2b.1 (ZB-H1's bubble at any costs)"
EX_2 = "Exercise 2b.2 (ZB-H1 from 1F1B's building block)"
EX_3 = "Exercise 2b.3 (I and W by hand)"




# 2b.1 --------------------------------------------------------------------------------
def zb_h1_bubble(p, f, i, w):
    return (p - 1) * max(f + i - w, f, i)


def bubble_table(p, f, i, w):            # the issue's: values copied from old messages
    simulated = {(2, 1.0, 1.0, 1.0): 1.0, (3, 1.0, 1.0, 1.0): 2.0, (4, 1.0, 1.0, 1.0): 3.0}
    return simulated.get((p, f, i, w), zb_h1_bubble(p, f, i, w) + 0.5) if (p, f, i, w) \
        not in {(p_, *c) for p_ in (2, 3, 4) for c in nb02b.BUBBLE_COSTS} \
        else zb_h1_bubble(p, f, i, w)


def test_2b_1_solution_passes():
    passes(EX_1, nb02b.check_zb_h1_bubble, zb_h1_bubble)


def test_2b_1_right_answer_written_another_way_passes():
    passes(EX_1, nb02b.check_zb_h1_bubble, lambda p, f, i, w: max(
        (p - 1) * (f + i - w), (p - 1) * f, (p - 1) * i))


def test_2b_1_a_table_of_the_shown_cases_fails_on_the_drawn_ones():
    for _ in range(3):
        fails(EX_1, nb02b.check_zb_h1_bubble, bubble_table, says="your formula gives")


@pytest.mark.parametrize("answer, says", [
    (lambda p, f, i, w: (p - 1) * (f + i - w), "the published formula"),   # DeepSeek's, 02's
    # another formula, equal to the published one where W <= F: the message says only that
    (lambda p, f, i, w: (p - 1) * (f + i - w if w <= f else f + i + w),
     "your value equals the published formula's here"),
    (lambda p, f, i, w: (p - 1) * (f + i + w), "1F1B's bubble"),
    (lambda p, f, i, w: (p - 1) * f, "your formula gives"),
    (lambda p, f, i, w: (p - 1) * max(f + i - w, f), "your formula gives"),
    (lambda p, f, i, w: (p - 1) * max(f + i - w, 0), "your formula gives"),
    (lambda p, f, i, w: (p - 1) * max(f + i - w, f, i, w), "your formula gives"),  # W waits
    (lambda p, f, i, w: p * max(f + i - w, f, i), "your formula gives"),       # p, not p - 1
    (lambda p, f, i, w: (p - 1) * max(f + i - w, i), "your formula gives"),
    (lambda p, f, i, w: (p - 1) * (f + i - min(w, i)), "your formula gives"),
])
def test_2b_1_wrong_answers_fail(answer, says):
    message = fails(EX_1, nb02b.check_zb_h1_bubble, answer, says=says)
    assert "idles " not in message.split("your formula gives")[0]      # no simulated value


def test_2b_1_library_shortcut_fails():
    def by_simulating(p, f, i, w, _build=BUILDERS["zb_h1"]):    # bound before the check
        s = _build(p, 3 * p)
        return max(r.bubble for r in rank_facts(s, simulate(s, forward=f, backward=i + w,
                                                            weight=w)))
    fails(EX_1, nb02b.check_zb_h1_bubble, by_simulating, says="your code calls")


#: ZB-H1 for every size 2b.1 draws, and its order, made before the check
PREBUILT = {p: (zb_h1(p, 3 * p), execution_order(zb_h1(p, 3 * p))) for p in range(2, 7)}
ZB_H1_COPY, SIMULATE_COPY = copied(zb_h1), copied(simulate, "my_simulate")
ZB_H1_SOURCE = copied(zb_h1, "mine")


def by_the_private_engine(p, f, i, w):        # the readers': _simulate on execution_order
    schedule, order = PREBUILT[p]
    t = _simulate(schedule, order, {"F": [f] * p, "B": [i + w] * p, "I": [i] * p,
                                    "W": [w] * p}, 0.0)
    busy = [sum(e.duration for e in t.events if e.rank == r) for r in range(p)]
    return t.makespan - min(busy)


def by_copies(p, f, i, w):                    # the builder and the simulator, copied
    s = ZB_H1_COPY(p, 3 * p)
    t = SIMULATE_COPY(s, forward=f, backward=i + w, weight=w)
    return t.makespan - min(sum(e.duration for e in t.events if e.rank == r)
                            for r in range(p))


@pytest.mark.parametrize("answer", [by_the_private_engine, by_copies])
def test_2b_1_the_simulator_reached_another_way_fails(answer):
    fails(EX_1, nb02b.check_zb_h1_bubble, answer, says="your code calls `")


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
    (lambda p, m: my_zb_h1(p, m, lag=lambda p, s: p - s), "a rank holds"),
    (lambda p, m: my_zb_h1(p, m, ahead=lambda p, s: p - s - 1), "not valid"),
    (lambda p, m: my_zb_h1(p, m) if (p, m) in nb02b.ZB_SIZES
     else my_zb_h1(p, m, lag=lambda p, s: 0), "weight lag"),   # right on the shown sizes only
])
def test_2b_2_wrong_answers_fail(answer, says):
    fails(EX_2, nb02b.check_my_zb_h1, answer, says=says)


def test_2b_2_a_step_too_long_is_told_without_zb_h1s_step():
    message = fails(EX_2, nb02b.check_my_zb_h1, lambda p, m: my_zb_h1(p, m, lag=lambda p, s: 0),
                    says="longer than ZB-H1's")
    assert re.search(r"ZB-H1's \d", message) is None, message


@pytest.mark.parametrize("answer", [
    lambda p, m: zb_h1(p, m), lambda p, m: build("zb_h1", p, m),
    lambda p, m: BUILDERS["zb_h1"](p, m),            # the issue's: the builders' dict
    lambda p, m, _b=zb_h1: _b(p, m),
    lambda p, m: ZB_H1_COPY(p, m),                   # the readers': a copy of its code
    lambda p, m: ZB_H1_SOURCE(p, m),                 # its source, run again before
    lambda p, m: copied(zb_h1, "mine")(p, m),        # ... or inside the check
])
def test_2b_2_library_shortcut_fails(answer):
    fails(EX_2, nb02b.check_my_zb_h1, answer, says="your code calls")


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


def via_scalar(stage, x, g):                 # the issue's: (y * g).sum(), same graph
    x = x.detach().requires_grad_()
    y = stage(x)
    loss = (y * g).sum()
    (grad_x,) = torch.autograd.grad(loss, [x], retain_graph=True)
    return grad_x, list(torch.autograd.grad(loss, list(stage.parameters())))


def weight_by_weight(stage, x, g):           # W as one pass per weight: fine
    x = x.detach().requires_grad_()
    y = stage(x)
    (grad_x,) = torch.autograd.grad(y, [x], g, retain_graph=True)
    return grad_x, [torch.autograd.grad(y, [p], g, retain_graph=True)[0]
                    for p in stage.parameters()]


def input_again_in_w(stage, x, g):
    x = x.detach().requires_grad_()
    y = stage(x)
    (grad_x,) = torch.autograd.grad(y, [x], g, retain_graph=True)
    grads = torch.autograd.grad(y, [x, *stage.parameters()], g)
    return grad_x, list(grads[1:])


def last_weights_only(stage, x, g):
    x = x.detach().requires_grad_()
    y = stage(x)
    (grad_x,) = torch.autograd.grad(y, [x], g, retain_graph=True)
    params = list(stage.parameters())
    last = torch.autograd.grad(y, params[-2:], g)
    return grad_x, [torch.zeros_like(p) for p in params[:-2]] + list(last)


def weights_as_a_dict(stage, x, g):          # a structure the check must name, not crash on
    x = x.detach().requires_grad_()
    y = stage(x)
    (grad_x,) = torch.autograd.grad(y, [x], g, retain_graph=True)
    names = [n for n, _ in stage.named_parameters()]
    return grad_x, dict(zip(names, torch.autograd.grad(y, list(stage.parameters()), g)))


def negated_input_gradient(stage, x, g):
    grad_x, grad_w = input_then_weight(stage, x, g)
    return -grad_x, grad_w


def test_2b_3_solution_passes():
    passes(EX_3, nb02b.check_input_then_weight, input_then_weight)


def right_on_the_shown_stages_only(stage, x, g):    # remembers the notebook's stages
    shown = [(rows, (widths[0], widths[-1])) for rows, widths in nb02b.SHOWN_STAGES]
    grad_x, grad_w = input_then_weight(stage, x, g)
    if (len(x), (x.size(1), g.size(1))) in shown:
        return grad_x, grad_w
    return grad_x, [torch.zeros_like(w) for w in grad_w]


def test_2b_3_an_answer_right_on_the_shown_stages_only_fails_on_the_drawn_ones():
    for _ in range(3):
        fails(EX_3, nb02b.check_input_then_weight, right_on_the_shown_stages_only,
              says="weight gradients differ")


@pytest.mark.parametrize("answer", [via_scalar, weight_by_weight])
def test_2b_3_right_answers_written_another_way_pass(answer):
    passes(EX_3, nb02b.check_input_then_weight, answer)


@pytest.mark.parametrize("answer, says", [
    (both_at_once, "ran 1 backward pass"),
    (weight_first, "first backward pass computes weight gradients"),
    (forward_again, "forward 2 times"),
    (graph_not_kept, "RuntimeError"),
    (with_backward, "`.grad` is filled"),
    (input_again_in_w, "computes the input's gradient again"),
    (last_weights_only, "every weight's gradient"),
    (weights_as_a_dict, "list of"),
    (negated_input_gradient, "input gradient differs"),
])
def test_2b_3_wrong_answers_fail(answer, says):
    message = fails(EX_3, nb02b.check_input_then_weight, answer, says=says)
    assert "your code raised" not in message or says == "RuntimeError", message


def test_2b_3_library_shortcut_fails():
    def split_by_the_library(stage, x, g):
        x = x.detach().requires_grad_()
        (grad_x,), later = backward_input([stage(x)], [g], [x], list(stage.parameters()))
        later.run()
        return grad_x, [p.grad for p in stage.parameters()]
    fails(EX_3, nb02b.check_input_then_weight, split_by_the_library,
          says="your code calls `backward_input`")
