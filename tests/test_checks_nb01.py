"""Notebook 01's exercise checks: the solution passes; plausible wrong answers, and the
library function that is the answer, each fail with the exercise's own message."""
from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch
from torch import nn

from pipeline_lib.course.checks import nb01
from pipeline_lib.microbatch import gather, loss_weights, split
from pipeline_lib.schedules import gpipe
from pipeline_lib.timeline import simulate
from conftest import fails, passes

loss_fn = nn.functional.mse_loss

EX_1_1 = "Exercise 1.1 (splitting and gathering by hand)"
EX_1_2 = "Exercise 1.2 (weighting the micro-batch losses)"
EX_1_3 = "Exercise 1.3 (utilisation and the fewest micro-batches)"
EX_1_4 = "Exercise 1.4 (GPipe's step on unequal stages)"




# 1.1 ---------------------------------------------------------------------------------
def split_rows(batch, m):
    size, extra = divmod(len(batch), m)
    micro_batches, start = [], 0
    for k in range(m):
        rows = size + (1 if k < extra else 0)
        micro_batches.append(batch[start:start + rows])
        start += rows
    return micro_batches


def gather_rows(micro_batches):
    return torch.cat(micro_batches)


def split_smaller_first(batch, m):         # 10 rows in 4: 2, 2, 3, 3
    size, extra = divmod(len(batch), m)
    sizes = [size + (1 if k >= m - extra else 0) for k in range(m)]
    return list(torch.split(batch, sizes))


def split_by_ceil(batch, m):               # torch.split(ceil(B/m)): 10 in 4 -> 3, 3, 3, 1
    return list(torch.split(batch, math.ceil(len(batch) / m)))


def split_strided(batch, m):               # every m-th row: right sizes, wrong rows
    return [batch[k::m] for k in range(m)]


def gather_reversed(micro_batches):
    return torch.cat(list(reversed(micro_batches)))


def test_1_1_solution_passes():
    passes(EX_1_1, nb01.check_split_and_gather, split_rows, gather_rows)


@pytest.mark.parametrize("answer, says", [
    ((split_smaller_first, gather_rows), "larger ones first"),
    ((split_by_ceil, gather_rows), "expected [3, 3, 2, 2]"),
    ((split_strided, gather_rows), "rows are not"),
    ((split_rows, gather_reversed), "in order"),
])
def test_1_1_wrong_answers_fail(answer, says):
    fails(EX_1_1, nb01.check_split_and_gather, *answer, says=says)


def test_1_1_library_shortcut_fails():
    fails(EX_1_1, nb01.check_split_and_gather, lambda b, m: split(b, m),
          lambda micro_batches: gather(micro_batches), globals(), says="your code calls `split`")


# 1.2 ---------------------------------------------------------------------------------
def accumulate(model, x, y, m):
    total = torch.zeros(())
    for xi, yi in zip(split(x, m), split(y, m)):
        loss = loss_fn(model(xi), yi) * len(xi) / len(x)
        loss.backward()
        total += loss.detach()
    return total


def whole_batch(model, x, y, m):           # no split at all: the right gradients
    loss = loss_fn(model(x), y)
    loss.backward()
    return loss.detach()


def divided_by_m(model, x, y, m):          # right only when the micro-batches are equal
    total = torch.zeros(())
    for xi, yi in zip(split(x, m), split(y, m)):
        loss = loss_fn(model(xi), yi) / m
        loss.backward()
        total += loss.detach()
    return total


def unscaled(model, x, y, m):              # the sum of the means
    total = torch.zeros(())
    for xi, yi in zip(split(x, m), split(y, m)):
        loss = loss_fn(model(xi), yi)
        loss.backward()
        total += loss.detach()
    return total


def one_backward_at_the_end(model, x, y, m):   # right numbers, every activation held
    losses = [loss_fn(model(xi), yi) * len(xi) / len(x) for xi, yi in zip(split(x, m),
                                                                          split(y, m))]
    total = sum(losses)
    total.backward()
    return total.detach()


def test_1_2_solution_passes():
    passes(EX_1_2, nb01.check_accumulate, accumulate)


@pytest.mark.parametrize("answer, says", [
    (whole_batch, "once per micro-batch"),
    (divided_by_m, "weighted by its share"),
    (unscaled, "weighted by its share"),
    (one_backward_at_the_end, "before the next micro-batch's forward"),
])
def test_1_2_wrong_answers_fail(answer, says):
    fails(EX_1_2, nb01.check_accumulate, answer, says=says)


def with_library_weights(model, x, y, m):   # the library's weights: the exercise's answer
    total, targets = torch.zeros(()), split(y, m)
    for xi, yi, weight in zip(split(x, m), targets, loss_weights(targets)):
        loss = nn.functional.mse_loss(model(xi), yi) * weight
        loss.backward()
        total += loss.detach()
    return total


def test_1_2_library_shortcut_fails():
    fails(EX_1_2, nb01.check_accumulate, with_library_weights, globals(),
          says="your code calls `loss_weights`")


# 1.3 ---------------------------------------------------------------------------------
def utilisation(p):
    return 1 / p


def fewest(p, target):
    return max(1, math.ceil((p - 1) * (1 - target) / target))


def fewest_floor(p, target):
    return max(1, math.floor((p - 1) * (1 - target) / target))


def fewest_int(p, target):
    return max(1, int((p - 1) * (1 - target) / target))


def fewest_round(p, target):
    return max(1, round((p - 1) * (1 - target) / target))


def fewest_ideal_convention(p, target):    # (p - 1) / m <= target: the other yardstick
    return max(1, math.ceil((p - 1) / target))


def fewest_by_simulating(p, target):
    m = 1
    while simulate(gpipe(p, m)).bubble_fraction() > target:
        m += 1
    return m


def test_1_3_solution_passes():
    passes(EX_1_3, nb01.check_bubble_formulas, utilisation, fewest)


@pytest.mark.parametrize("answer, says", [
    ((utilisation, fewest_floor), "too few"),
    ((utilisation, fewest_int), "too few"),
    ((utilisation, fewest_round), "too few"),
    ((utilisation, fewest_ideal_convention), "not the fewest"),
    ((lambda p: 1 - 1 / p, fewest), "utilisation, not idle time"),
])
def test_1_3_wrong_answers_fail(answer, says):
    fails(EX_1_3, nb01.check_bubble_formulas, *answer, says=says)


def test_1_3_library_shortcut_fails():
    fails(EX_1_3, nb01.check_bubble_formulas,
          lambda p: 1 - simulate(gpipe(p, 1)).bubble_fraction(), fewest_by_simulating,
          globals(), says="your code calls `simulate`")


def test_1_3_targets_part_floor_from_ceil():
    assert fewest(4, Fraction(2, 5)) == 5 and fewest_floor(4, Fraction(2, 5)) == 4


# 1.4 ---------------------------------------------------------------------------------
def step_time(forward, backward, m):
    p = len(forward)
    free, ready = [0.0] * p, [0.0] * m
    for s in range(p):
        for i in range(m):
            free[s] = ready[i] = max(free[s], ready[i]) + forward[s]
    for s in reversed(range(p)):
        for i in range(m):
            free[s] = ready[i] = max(free[s], ready[i] if s < p - 1 else 0.0) + backward[s]
    return max(free)


def equal_stage_formula(forward, backward, m):      # (m + p - 1) slots of the mean stage
    p = len(forward)
    return (m + p - 1) * (sum(forward) + sum(backward)) / p


def slowest_stage_everywhere(forward, backward, m):
    return (m + len(forward) - 1) * (max(forward) + max(backward))


def slowest_pair(forward, backward, m):              # the bottleneck as one F+B pair
    return sum(forward) + sum(backward) + (m - 1) * max(f + b for f, b in
                                                       zip(forward, backward))


def one_after_another(forward, backward, m):
    return m * (sum(forward) + sum(backward))


def test_1_4_solution_passes():
    passes(EX_1_4, nb01.check_unequal_gpipe, step_time)


@pytest.mark.parametrize("answer", [equal_stage_formula, slowest_stage_everywhere,
                                    slowest_pair, one_after_another])
def test_1_4_wrong_answers_fail(answer):
    fails(EX_1_4, nb01.check_unequal_gpipe, answer, says="GPipe's takes")


def test_1_4_library_shortcut_fails():
    fails(EX_1_4, nb01.check_unequal_gpipe,
          lambda f, b, m: simulate(gpipe(len(f), m), forward=f, backward=b).makespan,
          globals(), says="your code calls")
