"""Notebook 01's exercise checks: the solution passes; plausible wrong answers, and the
library function that is the answer, each fail with the exercise's own message."""
from __future__ import annotations

import math
import re
from fractions import Fraction

import pytest
import torch
from torch import nn

from pipeline_lib.course.checks import nb01
from pipeline_lib.microbatch import gather, loss_weights, split
from pipeline_lib.schedules import execution_order, gpipe
from pipeline_lib.timeline import _simulate, bubble_theory, simulate
from conftest import fails, passes
from copies import copied

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


def split_detached(batch, m):               # the issue's: right rows, copied out of the graph
    return [torch.tensor(part.tolist()) for part in split_rows(batch, m)]


def split_numpy(batch, m):                  # numpy's array_split: sizes right, graph lost
    import numpy as np
    return [torch.from_numpy(a) for a in np.array_split(batch.detach().numpy(), m)]


def split_reshape(batch, m):                # only when m divides the rows
    return list(batch.reshape(m, -1, *batch.shape[1:]))


def split_sizes_of_shown_cases(batch, m):   # a table of the sizes the messages once printed
    table = {(8, 4): [2, 2, 2, 2], (10, 4): [3, 3, 2, 2], (7, 7): [1] * 7, (5, 1): [5],
             (11, 3): [4, 4, 3]}
    return list(torch.split(batch, table[len(batch), m]))


def split_captured(batch, m, _split=split):   # the issue's: the library bound as a default
    return _split(batch, m)


def gather_detached(micro_batches):
    return torch.cat(micro_batches).detach()


def gather_stacked(micro_batches):          # a new dimension instead of dim 0
    return torch.stack([mb.sum(0) for mb in micro_batches])


def test_1_1_solution_passes():
    passes(EX_1_1, nb01.check_split_and_gather, split_rows, gather_rows)


@pytest.mark.parametrize("split_", [
    lambda batch, m: list(torch.tensor_split(batch, m)),        # larger first, as asked
    lambda batch, m: [part.clone() for part in split_rows(batch, m)],   # clones, as split
    lambda batch, m: [batch.narrow(0, sum(split_rows(batch, m)[k].shape[0] for k in range(i)),
                                   len(part)) for i, part in enumerate(split_rows(batch, m))],
    lambda batch, m: [batch.index_select(0, torch.arange(a, a + len(part)))
                      for a, part in zip(
                          [sum(len(q) for q in split_rows(batch, m)[:i]) for i in range(m)],
                          split_rows(batch, m))],                # copies, still in the graph
])
def test_1_1_right_answers_written_another_way_pass(split_):
    passes(EX_1_1, nb01.check_split_and_gather, split_, lambda mbs: torch.concat(list(mbs)))


@pytest.mark.parametrize("answer, says", [
    ((split_smaller_first, gather_rows), "larger micro-batches come first"),
    ((split_by_ceil, gather_rows), "differ by more than one row"),
    ((split_strided, gather_rows), "rows are not"),
    ((split_rows, gather_reversed), "in order"),
    ((split_detached, gather_rows), "cut off from the batch's graph"),
    ((split_numpy, gather_rows), "cut off from the batch's graph"),
    ((split_reshape, gather_rows), "RuntimeError"),
    ((split_rows, gather_detached), "cut off from the micro-batches' graph"),
    ((split_rows, gather_stacked), "does not give back the batch"),
])
def test_1_1_wrong_answers_fail(answer, says):
    message = fails(EX_1_1, nb01.check_split_and_gather, *answer, says=says)
    assert "expected" not in message and "[3, 3, 2, 2]" not in message   # no answer given


def test_1_1_a_copy_cut_off_the_graph_is_told_clones_are_fine():
    message = fails(EX_1_1, nb01.check_split_and_gather, split_detached, gather_rows,
                    says="cut off")
    assert ".clone()" in message and "torch.tensor(...), .detach(), numpy" in message


def test_1_1_a_table_of_the_shown_cases_fails_on_the_drawn_ones():
    for _ in range(3):
        fails(EX_1_1, nb01.check_split_and_gather, split_sizes_of_shown_cases, gather_rows,
              says="KeyError")


SPLIT_COPY, SPLIT_SOURCE, GATHER_COPY = copied(split), copied(split, "mine"), copied(gather)


@pytest.mark.parametrize("answer", [
    (lambda b, m: split(b, m), gather_rows),
    (split_captured, gather_rows),
    (lambda b, m: SPLIT_COPY(b, m), gather_rows),          # the readers': copies of the code
    (lambda b, m: SPLIT_SOURCE(b, m), gather_rows),
    (split_rows, lambda micro_batches: GATHER_COPY(micro_batches)),
    (split_rows, lambda micro_batches, _join=gather: _join(micro_batches)),
    (lambda b, m: __import__("pipeline_lib").microbatch.split(b, m), gather_rows),
])
def test_1_1_library_shortcut_fails(answer):
    fails(EX_1_1, nb01.check_split_and_gather, *answer, says="your code calls `")


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


def summed_not_mean(model, x, y, m):       # each micro-batch's sum: B times the gradient
    total = torch.zeros(())
    for xi, yi in zip(split(x, m), split(y, m)):
        loss = loss_fn(model(xi), yi) * len(xi)
        loss.backward()
        total += loss.detach()
    return total


def loss_still_attached(model, x, y, m):
    total = torch.zeros(())
    for xi, yi in zip(split(x, m), split(y, m)):
        loss = loss_fn(model(xi), yi) * len(xi) / len(x)
        loss.backward()
        total = total + loss
    return total


def weights_captured(model, x, y, m, _weights=loss_weights):   # the library, as a default
    total, targets = torch.zeros(()), split(y, m)
    for xi, yi, w in zip(split(x, m), targets, _weights(targets)):
        loss = loss_fn(model(xi), yi) * w
        loss.backward()
        total += loss.detach()
    return total


def mean_of_means_returned(model, x, y, m):    # right gradients, the loss of equal weights
    losses = []
    for xi, yi in zip(split(x, m), split(y, m)):
        loss = loss_fn(model(xi), yi)
        (loss * len(xi) / len(x)).backward()
        losses.append(loss.detach())
    return sum(losses) / m


def test_1_2_solution_passes():
    passes(EX_1_2, nb01.check_accumulate, accumulate)


def test_1_2_right_answer_written_another_way_passes():
    def with_sum_reduction(model, x, y, m):      # sums over rows, divided by the batch's count
        total = torch.zeros(())
        for xi, yi in zip(split(x, m), split(y, m)):
            loss = nn.functional.mse_loss(model(xi), yi, reduction="sum") / y.numel()
            loss.backward()
            total += loss.detach()
        return total
    passes(EX_1_2, nb01.check_accumulate, with_sum_reduction)


@pytest.mark.parametrize("answer, says", [
    (whole_batch, "once per micro-batch"),
    (divided_by_m, "weighted by its share"),
    (unscaled, "weighted by its share"),
    (one_backward_at_the_end, "before the next micro-batch's forward"),
    (summed_not_mean, "weighted by its share"),
    (loss_still_attached, "detached"),
    (mean_of_means_returned, "weighted by its share"),
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


@pytest.mark.parametrize("answer", [with_library_weights, weights_captured])
def test_1_2_library_shortcut_fails(answer):
    fails(EX_1_2, nb01.check_accumulate, answer, says="your code calls `loss_weights`")


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


def fewest_without_floor_at_one(p, target):    # 0 micro-batches when p = 1
    return math.ceil((p - 1) * (1 - target) / target)


def fewest_table(p, target):                      # copied from the messages of old checks
    return {(4, Fraction(2, 5)): 5, (8, Fraction(3, 10)): 17, (4, Fraction(1, 5)): 12,
            (3, Fraction(2, 7)): 5, (2, Fraction(1, 2)): 1, (6, Fraction(1, 3)): 10,
            (1, Fraction(1, 10)): 1}[p, target]


def fewest_float(p, target):                      # floats: 3 x 0.8 / 0.2 = 12.000000000000002
    return max(1, math.ceil((p - 1) * (1 - float(target)) / float(target)))


def utilisation_table(p):                         # the shown p = 1..8 only
    return {1: 1.0, 2: 0.5, 3: 1 / 3, 4: 0.25, 5: 0.2, 6: 1 / 6, 7: 1 / 7, 8: 0.125}[p]


def test_1_3_solution_passes():
    passes(EX_1_3, nb01.check_bubble_formulas, utilisation, fewest)


def fewest_by_search(p, target):                 # the formula tried m after m
    m = 1
    while Fraction(p - 1, m + p - 1) > target:
        m += 1
    return m


@pytest.mark.parametrize("answer", [
    (lambda p: Fraction(1, p), fewest),            # the issue's: exact, refused before
    (lambda p: 1 / p, lambda p, t: max(1, -((-(p - 1) * (1 - t)) // t))),   # ceil by //
    (utilisation, fewest_by_search),
])
def test_1_3_right_answers_written_another_way_pass(answer):
    passes(EX_1_3, nb01.check_bubble_formulas, *answer)


@pytest.mark.parametrize("answer, says", [
    ((utilisation, fewest_floor), "too few"),
    ((utilisation, fewest_int), "too few"),
    ((utilisation, fewest_round), "too few"),
    ((utilisation, fewest_ideal_convention), "not the fewest"),
    ((lambda p: 1 - 1 / p, fewest), "the share each device idles"),
    ((lambda p: 1 / (p + 1), fewest), "not the share"),
    ((utilisation, fewest_without_floor_at_one), "whole number >= 1"),
    ((utilisation, fewest_float), "not the fewest"),
])
def test_1_3_wrong_answers_fail(answer, says):
    message = fails(EX_1_3, nb01.check_bubble_formulas, *answer, says=says)
    assert "each device computes 0." not in message      # no expected value printed


@pytest.mark.parametrize("answer, says", [
    ((utilisation, fewest_table), "KeyError"),
    ((utilisation_table, fewest), "KeyError"),
])
def test_1_3_tables_of_the_shown_cases_fail_on_the_drawn_ones(answer, says):
    for _ in range(3):
        fails(EX_1_3, nb01.check_bubble_formulas, *answer, says=says)


def private_simulator(p, m=1):
    """The readers' route: the simulator's private engine on the order it times."""
    schedule = gpipe(p, m)
    cost = {"F": [1.0] * p, "B": [2.0] * p, "I": [1.0] * p, "W": [1.0] * p}
    return _simulate(schedule, execution_order(schedule), cost, 0.0)


SIMULATE_COPY = copied(simulate)
#: GPipe's schedules and their orders for every size 1.4 draws, made before the check: a
#: learner's route to the simulator's private engine with nothing else withheld on the way
PREBUILT = {(p, m): (gpipe(p, m), execution_order(gpipe(p, m)))
            for p in range(1, 6) for m in range(1, 8)}


@pytest.mark.parametrize("answer", [
    (lambda p: 1 - private_simulator(p).bubble_fraction(), fewest),
    (utilisation, lambda p, t: next(m for m in range(1, 10_000)
                                    if private_simulator(p, m).bubble_fraction() <= t)),
    (lambda p: 1 - SIMULATE_COPY(gpipe(p, 1)).bubble_fraction(), fewest),
    (lambda p: 1 - simulate(gpipe(p, 1)).bubble_fraction(), fewest_by_simulating),
    (utilisation, lambda p, t, _b=bubble_theory: next(m for m in range(1, 10_000)
                                                     if _b(p, m) <= t)),
])
def test_1_3_library_shortcut_fails(answer):
    fails(EX_1_3, nb01.check_bubble_formulas, *answer, says="your code calls")


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


def closed_form(forward, backward, m):           # the issue's: each phase its own slowest stage
    return sum(forward) + sum(backward) + (m - 1) * (max(forward) + max(backward))


def backwards_first_stage_first(forward, backward, m):   # the backward walked the wrong way
    p = len(forward)
    free, ready = [0.0] * p, [0.0] * m
    for s in range(p):
        for i in range(m):
            free[s] = ready[i] = max(free[s], ready[i]) + forward[s]
    for s in range(p):
        for i in range(m):
            free[s] = ready[i] = max(free[s], ready[i]) + backward[s]
    return max(free)


def slowest_forward_only(forward, backward, m):
    return sum(forward) + sum(backward) + (m - 1) * max(forward)


def step_table(forward, backward, m):              # the shown pipelines' steps, copied
    return {((1.0, 3.0, 1.0), (5.0, 2.0, 2.0), 4): 38.0}.get(
        (tuple(forward), tuple(backward), m), closed_form(forward, backward, m) + 1)


def test_1_4_solution_passes():
    passes(EX_1_4, nb01.check_unequal_gpipe, step_time)


def test_1_4_the_closed_form_passes():
    passes(EX_1_4, nb01.check_unequal_gpipe, closed_form)


@pytest.mark.parametrize("answer", [equal_stage_formula, slowest_stage_everywhere,
                                    slowest_pair, one_after_another,
                                    backwards_first_stage_first, slowest_forward_only,
                                    step_table])
def test_1_4_wrong_answers_fail(answer):
    message = fails(EX_1_4, nb01.check_unequal_gpipe, answer, says="GPipe's takes")
    assert re.search(r"GPipe's takes (longer|less)\.", message), message   # not its value


@pytest.mark.parametrize("answer", [
    lambda f, b, m: simulate(gpipe(len(f), m), forward=f, backward=b).makespan,
    lambda f, b, m, _sim=simulate, _g=gpipe: _sim(_g(len(f), m), forward=f,
                                                 backward=b).makespan,
    lambda f, b, m: simulate(__import__("pipeline_lib").schedules.BUILDERS["gpipe"](
        len(f), m), forward=f, backward=b).makespan,
    lambda f, b, m: SIMULATE_COPY(copied(gpipe)(len(f), m), forward=f, backward=b).makespan,
    lambda f, b, m: _simulate(PREBUILT[len(f), m][0], PREBUILT[len(f), m][1],
                              {"F": f, "B": b, "I": b, "W": b}, 0.0).makespan,
])
def test_1_4_library_shortcut_fails(answer):
    fails(EX_1_4, nb01.check_unequal_gpipe, answer, says="your code calls")
