"""Notebook 05's exercise checks, run in-process: each solution passes; each plausible
wrong answer and each library shortcut fails with its exercise's own message; and the
cost model that grades 5.1."""
from __future__ import annotations

import pytest
import torch

from pipeline_lib.course.checks.nb05 import (CLUSTER_5_1, Cluster, check_5_1, check_5_2,
                                             check_5_3, cases_5_2, jobs_5_1,
                                             cheapest_grid, communication_seconds,
                                             grid_problem)
from pipeline_lib.course.exercises import ExerciseFailed, exercise
from pipeline_lib.grad_clip import clip_grad_norm_


def fails(check, answer, says: str, name: str) -> str:
    with pytest.raises(ExerciseFailed) as failed, exercise(name):
        check(answer)
    assert str(failed.value).startswith(name) and says in str(failed.value), failed.value
    return str(failed.value)


# -- 5.1 ----------------------------------------------------------------------------------------

E51 = "Exercise 5.1 (where the ranks go)"
PIPES_IN = ([[0, 1], [2, 3]], [[0, 2], [1, 3]])   # each pipeline on one machine
DDP_IN = ([[0, 2], [1, 3]], [[0, 1], [2, 3]])     # each DDP group on one machine


def place(all_reduce, pipeline, fast, slow):
    if pipeline / slow + all_reduce / fast < pipeline / fast + all_reduce / slow:
        return DDP_IN
    return PIPES_IN


def test_5_1_solution_passes():
    check_5_1(place)


@pytest.mark.parametrize("answer, says", [
    (lambda a, p, f, s: PIPES_IN, "communicate"),                    # the mesh's default order
    (lambda a, p, f, s: DDP_IN, "communicate"),                      # always DDP inside
    (lambda a, p, f, s: PIPES_IN if a > p else DDP_IN, "communicate"),   # backwards
    (lambda a, p, f, s: DDP_IN if a > 10 * p else PIPES_IN, "communicate"),  # rule of thumb
    (lambda a, p, f, s: DDP_IN if 2 * a > p else PIPES_IN, "communicate"),   # ring bytes x2
    (lambda a, p, f, s: DDP_IN if a > 2 * p else PIPES_IN, "communicate"),   # both ways x2
    (lambda a, p, f, s: (DDP_IN[0], DDP_IN[0]), "DDP group s holds stage s"),
], ids=["pipelines inside", "DDP inside", "backwards", "ten times rule", "all-reduce doubled",
        "pipeline doubled", "not a grid"])
def test_5_1_wrong_answers_fail(answer, says):
    fails(check_5_1, answer, says, E51)


def test_5_1_graders_cost_model_is_withheld():
    def via_cheapest(a, p, fast, slow):
        return cheapest_grid(Cluster(2, 2, fast, slow), 2, 2, a, p)

    def via_cost(a, p, fast, slow):
        return min((PIPES_IN, DDP_IN), key=lambda g: sum(communication_seconds(
            Cluster(2, 2, fast, slow), g, a, p)))

    def captured(a, p, fast, slow, _cost=communication_seconds):   # bound before the check
        return min((PIPES_IN, DDP_IN), key=lambda g: sum(_cost(Cluster(2, 2, fast, slow),
                                                               g, a, p)))

    for shortcut in (via_cheapest, via_cost, captured):
        fails(check_5_1, shortcut, "computes the very answer", E51)


def test_5_1_messages_name_no_cheapest_grid():
    message = fails(check_5_1, lambda a, p, f, s: PIPES_IN, "another grid communicates less",
                    E51)
    assert f"pipelines {DDP_IN[0]}" not in message and "times" not in message
    assert message.count(" ms") == 1, message          # yours, not the cheaper grid's


def test_5_1_a_table_of_the_shown_jobs_fails_on_the_drawn_ones():
    by_bytes = {bytes_: place(*bytes_, CLUSTER_5_1.fast, CLUSTER_5_1.slow)
                for bytes_ in jobs_5_1().values()}
    for _ in range(3):
        fails(check_5_1, lambda a, p, f, s: by_bytes[a, p], "KeyError", E51)


@pytest.mark.parametrize("answer", [
    lambda a, p, f, s: DDP_IN if a / s + p / f > a / f + p / s else PIPES_IN,   # = place
    lambda a, p, f, s: DDP_IN if a > p else PIPES_IN,     # the same here: one fast, one slow
])
def test_5_1_right_answers_written_another_way_pass(answer):
    check_5_1(answer)


# -- 5.2 ----------------------------------------------------------------------------------------

E52 = "Exercise 5.2 (bytes per step, counted)"


def step_bytes(stages, micro_batch, microbatches, dp, *, ring=True, both_ways=True, size=None,
               per_micro_batch=False, frozen_too=False, buffers_too=False):
    factor = 2 * (dp - 1) / dp if ring else 1
    all_reduce = [factor * sum(t.numel() * (size or t.element_size()) for t in
                               [p for p in s.parameters() if p.requires_grad or frozen_too]
                               + [b for b in s.buffers() if buffers_too and b.is_floating_point()])
                  for s in stages]
    boundary, x = [], micro_batch
    with torch.no_grad():
        for stage in stages[:-1]:
            x = stage(x)
            boundary.append((2 if both_ways else 1) * (1 if per_micro_batch else microbatches)
                            * x.numel() * (size or x.element_size()))
    return all_reduce, boundary


def step_bytes_on_inputs(stages, micro_batch, microbatches, dp):   # each stage's input counted
    all_reduce, _ = step_bytes(stages, micro_batch, microbatches, dp)
    boundary, x = [], micro_batch
    with torch.no_grad():
        for stage in stages[:-1]:
            boundary.append(2 * microbatches * x.numel() * x.element_size())
            x = stage(x)
    return all_reduce, boundary


def test_5_2_solution_passes():
    check_5_2(step_bytes)


@pytest.mark.parametrize("answer, says", [
    (lambda *a: step_bytes(*a, ring=False), "2(dp − 1)/dp"),
    (lambda *a: step_bytes(*a, both_ways=False), "2 (forward and backward)"),
    (lambda *a: step_bytes(*a, size=4), "8 bytes"),
    (lambda *a: step_bytes(*a, per_micro_batch=True), "micro-batches"),
    (lambda *a: step_bytes(*a, frozen_too=True), "a frozen parameter, requires_grad=False"),
    (lambda *a: step_bytes(*a, buffers_too=True), "buffers, such as BatchNorm's"),
], ids=["no ring factor", "forward only", "4 bytes assumed", "one micro-batch",
        "frozen parameter counted", "buffers counted"])
def test_5_2_wrong_answers_fail(answer, says):
    message = fails(check_5_2, answer, says, E52)
    assert "expected" not in message and "times" not in message


@pytest.mark.parametrize("answer, says", [
    (lambda *a: step_bytes(*a[:3], 2), "less than each rank of a ring"),   # dp = 2 always
    (lambda *a: step_bytes(*a[:3], 4), "more than each rank of a ring"),   # dp = 4 always
    (step_bytes_on_inputs, "than crosses it in a step"),
    (lambda *a: (step_bytes(*a)[0], [b // 2 for b in step_bytes(*a)[1]]),
     "less than crosses it in a step"),
    (lambda *a: step_bytes(*a)[0], "return a pair"),
])
def test_5_2_more_wrong_answers_fail(answer, says):
    fails(check_5_2, answer, says, E52)


def test_5_2_a_table_of_the_shown_counts_fails_on_the_drawn_mlp():
    table = {(len(stages), dp): step_bytes(stages, micro, m, dp)
             for stages, micro, m, *_ in cases_5_2().values() for dp in (2, 4)}
    for _ in range(3):
        fails(check_5_2, lambda stages, micro, m, dp: table[len(stages), dp], "", E52)


# -- 5.3 ----------------------------------------------------------------------------------------

E53 = "Exercise 5.3 (global gradient clipping on a dp × pp mesh)"


def clip(grads, max_norm, *, average=True, norm="global", always=False):
    """The solution (defaults) and the usual mistakes: no replica average first, a norm
    per pipeline rank, a norm over every rank of every replica, the sum of the ranks'
    norms, a factor applied even when the norm is below max_norm."""
    dp, pp = len(grads), len(grads[0])
    if average:
        for s in range(pp):
            for name in grads[0][s]:
                mean = sum(grads[d][s][name] for d in range(dp)) / dp
                for d in range(dp):
                    grads[d][s][name] = mean.clone()

    def squares(d, s):
        return sum(g.pow(2).sum() for g in grads[d][s].values())

    everywhere = sum(squares(d, s) for d in range(dp) for s in range(pp)).sqrt()
    norms = {d: {"global": [sum(squares(d, s) for s in range(pp)).sqrt()] * pp,
                 "stage": [squares(d, s).sqrt() for s in range(pp)],
                 "every rank": [everywhere] * pp,
                 "sum of norms": [sum(squares(d, s).sqrt() for s in range(pp))] * pp}[norm]
             for d in range(dp)}
    for d in range(dp):
        for s in range(pp):
            factor = max_norm / norms[d][s]
            factor = factor if always else min(1.0, factor)
            for name in grads[d][s]:
                grads[d][s][name] = grads[d][s][name] * factor
    return float(norms[0][0])


def test_5_3_solution_passes():
    check_5_3(clip)


@pytest.mark.parametrize("answer, says", [
    (lambda g, m: clip(g, m, norm="stage"), "pipeline ranks end scaled by different factors"),
    (lambda g, m: clip(g, m, average=False), "and replica 0 end with different gradients"),
    (lambda g, m: clip(g, m, norm="every rank"), "replica 0, pipeline rank"),
    (lambda g, m: clip(g, m, norm="sum of norms"), "replica 0, pipeline rank"),
    (lambda g, m: clip(g, m, always=True), "a clip above the norm"),
], ids=["per-stage norm (the DDP tutorial's local clip)", "no replica average",
        "norm over every rank of every replica", "sum of stage norms", "always scaled"])
def test_5_3_wrong_answers_fail(answer, says):
    fails(check_5_3, answer, says, E53)


@pytest.mark.parametrize("answer, says", [
    (lambda g, m: clip(g, m) * 2, "more than the whole model's gradient norm"),
    (lambda g, m: [clip(g, m)], "return the total norm"),
    (lambda g, m: clip(g, m, norm="every rank") if len(g) == 2 else clip(g, m),
     "replica 0, pipeline rank"),
])
def test_5_3_more_wrong_answers_fail(answer, says):
    fails(check_5_3, answer, says, E53)


def test_5_3_library_clip_is_withheld():
    def via_library(grads, max_norm):
        clip(grads, max_norm)      # the right gradients, but the norm asked of the library
        params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads[0][0].values()]
        for p, g in zip(params, grads[0][0].values()):
            p.grad = g
        return clip_grad_norm_(torch.nn.ParameterList(params), max_norm)

    fails(check_5_3, via_library, "computes the very answer", E53)


def test_5_3_torch_clip_is_withheld():
    """Averaged, then PyTorch's one-process clip over replica 0's whole gradient."""
    def via_torch(grads, max_norm):
        dp, pp = len(grads), len(grads[0])
        keys = [(s, name) for s in range(pp) for name in grads[0][s]]
        params = {}
        for s, name in keys:
            mean = sum(grads[d][s][name] for d in range(dp)) / dp
            params[s, name] = torch.nn.Parameter(torch.zeros_like(mean))
            params[s, name].grad = mean
        norm = torch.nn.utils.clip_grad_norm_(list(params.values()), max_norm)
        for d in range(dp):
            for s, name in keys:
                grads[d][s][name] = params[s, name].grad.clone()
        return norm

    fails(check_5_3, via_torch, "whole model's norm in one process", E53)

    fails(check_5_3, lambda g, m, _total=torch.nn.utils.get_total_norm: float(
        _total([t for s in g[0] for t in s.values()])), "whole model's norm in one process", E53)
    assert torch.nn.utils.clip_grad_norm_.__module__ == "torch.nn.utils.clip_grad"  # restored


# -- the placement cost model of exercise 5.1 --------------------------------------------------

TWO_BY_TWO = Cluster(machines=2, gpus=2, fast=100.0, slow=10.0)


def test_communication_seconds_is_bytes_over_each_groups_link():
    assert communication_seconds(TWO_BY_TWO, PIPES_IN, 1000, 50) == (0.5, 100.0)
    assert communication_seconds(TWO_BY_TWO, DDP_IN, 1000, 50) == (5.0, 10.0)


def test_the_group_that_moves_more_bytes_gets_the_fast_links():
    def one_machine(group):
        return len({r // TWO_BY_TWO.gpus for r in group}) == 1

    pipelines, dp_groups = cheapest_grid(TWO_BY_TWO, 2, 2, all_reduce_bytes=1000,
                                         pipeline_bytes=50)
    assert all(map(one_machine, dp_groups)) and not any(map(one_machine, pipelines))
    pipelines, dp_groups = cheapest_grid(TWO_BY_TWO, 2, 2, all_reduce_bytes=50,
                                         pipeline_bytes=1000)
    assert all(map(one_machine, pipelines)) and not any(map(one_machine, dp_groups))
    with pytest.raises(ValueError, match="must equal the cluster's 4 GPUs"):
        cheapest_grid(TWO_BY_TWO, 2, 3, 1, 1)


def test_grid_problem_names_what_is_wrong():
    assert grid_problem(*PIPES_IN, pp=2, dp=2) is None
    assert "every rank 0..3 once" in grid_problem([[0, 1], [1, 2]], [[0, 1], [1, 2]], 2, 2)
    assert "2 pipelines of 2 ranks" in grid_problem([[0, 1, 2, 3]], [[0], [1]], 2, 2)
    assert "they are [[0, 2], [1, 3]]" in grid_problem([[0, 1], [2, 3]], [[0, 1], [2, 3]], 2, 2)
    assert "lists of lists" in grid_problem(None, None, 2, 2)

