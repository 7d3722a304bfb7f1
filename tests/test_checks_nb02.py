"""Notebook 02's exercise checks: the solution passes; plausible wrong answers, and the
library function that is the answer, each fail with the exercise's own message."""
from __future__ import annotations


import pytest

from pipeline_lib.course.checks import nb02
from pipeline_lib.executor import run_program
from pipeline_lib.schedules import (Action, Schedule, build, gpipe, interleaved_1f1b,
                                    one_f_one_b, one_forward_one_backward)
from pipeline_lib.threaded.threads import run_threads
from pipeline_lib.timeline import simulate
from conftest import fails, passes

EX_2_1 = "Exercise 2.1 (GPipe as an action list)"
EX_2_2 = "Exercise 2.2 (1F1B as an action list)"
EX_2_3 = "Exercise 2.3 (a stage thread's loop)"
EX_2_4 = "Exercise 2.4 (activation memory counted from a program)"
EX_2_5 = "Exercise 2.5 (interleaved 1F1B in rounds)"




# 2.1 ---------------------------------------------------------------------------------
def gpipe_by_hand(stages, microbatches):
    programs = [[Action(s, "F", i) for i in range(microbatches)]
                + [Action(s, "B", i) for i in range(microbatches)] for s in range(stages)]
    return Schedule("GPipe by hand", stages, microbatches, programs)


def one_at_a_time(stages, microbatches):     # F0 B0 F1 B1: valid, never overlaps
    return Schedule("x", stages, microbatches,
                    [[Action(s, k, i) for i in range(microbatches) for k in "FB"]
                     for s in range(stages)])


def forwards_only(stages, microbatches):
    return Schedule("x", stages, microbatches,
                    [[Action(s, "F", i) for i in range(microbatches)] for s in range(stages)])


def sizes_swapped(stages, microbatches):
    return gpipe_by_hand(microbatches, stages) if stages != microbatches else \
        gpipe_by_hand(stages, microbatches + 1)


def test_2_1_solution_passes():
    passes(EX_2_1, nb02.check_gpipe, gpipe_by_hand)


@pytest.mark.parametrize("answer, says", [
    (lambda p, m: one_f_one_b_by_hand(p, m), "peak in-flight"),
    (one_at_a_time, "simulated bubble"),
    (forwards_only, "not a schedule that can run"),
    (sizes_swapped, "expected"),
])
def test_2_1_wrong_answers_fail(answer, says):
    fails(EX_2_1, nb02.check_gpipe, answer, says=says)


@pytest.mark.parametrize("answer", [lambda p, m: gpipe(p, m), lambda p, m: build("gpipe", p, m)])
def test_2_1_library_shortcut_fails(answer):
    fails(EX_2_1, nb02.check_gpipe, answer, globals(), says="your code calls")


# 2.2 ---------------------------------------------------------------------------------
def one_f_one_b_by_hand(stages, microbatches, ahead=lambda p, s: p - s):
    p, m = stages, microbatches
    programs = []
    for s in range(p):
        first = min(ahead(p, s), m)
        program = [Action(s, "F", i) for i in range(first)]
        for i in range(m):
            program.append(Action(s, "B", i))
            if first + i < m:
                program.append(Action(s, "F", first + i))
        programs.append(program)
    return Schedule("1F1B by hand", p, m, programs)


def test_2_2_solution_passes():
    passes(EX_2_2, nb02.check_one_f_one_b, one_f_one_b_by_hand)


@pytest.mark.parametrize("answer, says", [
    (lambda p, m: one_f_one_b_by_hand(p, m, lambda p, s: p - 1 - s), "not a schedule"),
    (lambda p, m: one_f_one_b_by_hand(p, m, lambda p, s: p), "simulated bubble"),
    (lambda p, m: one_f_one_b_by_hand(p, m, lambda p, s: 1), "simulated bubble"),
    (gpipe_by_hand, "1F1B holds"),
])
def test_2_2_wrong_answers_fail(answer, says):
    fails(EX_2_2, nb02.check_one_f_one_b, answer, says=says)


@pytest.mark.parametrize("answer", [
    lambda p, m: one_f_one_b(p, m),
    lambda p, m: Schedule("x", p, m, [one_forward_one_backward(
        [(s, i) for i in range(m)], [(s, i) for i in range(m)], p - s) for s in range(p)]),
])
def test_2_2_library_shortcut_fails(answer):
    fails(EX_2_2, nb02.check_one_f_one_b, answer, globals(), says="your code calls")


# 2.3 ---------------------------------------------------------------------------------
def stage_loop(runner, program, mail, stages, inputs, targets, order=None, as_b=False):
    for s, kind, i in (order(program) if order else program):
        if kind == "F":
            x = inputs[i] if s == 0 else mail.get(("activation", s, i))
            y = runner.forward(i, x, targets[i] if s == stages - 1 else None)
            if s < stages - 1:
                mail.put(("activation", s + 1, i), y)
        elif kind == "W":
            if not as_b:
                runner.backward_weight(i)
        else:
            grad = None if s == stages - 1 else mail.get(("gradient", s, i))
            backward = runner.backward if kind == "B" or as_b else runner.backward_input
            grad_in = backward(i, grad)
            if s > 0:
                mail.put(("gradient", s - 1, i), grad_in)


def forwards_then_backwards(program):        # ignores the program's order
    return sorted(program, key=lambda a: (a.kind != "F", a.kind == "W"))


def test_2_3_solution_passes():
    passes(EX_2_3, nb02.check_stage_loop, stage_loop)


@pytest.mark.parametrize("answer, says", [
    (lambda *a: stage_loop(*a, order=forwards_then_backwards), "but its program is"),
    (lambda *a: stage_loop(*a, as_b=True), "but its program is"),
    (lambda *a: stage_loop(*a, order=lambda program: program[:-1]), "but its program is"),
    (lambda r, program, *a: None, "computed no loss"),
])
def test_2_3_wrong_answers_fail(answer, says):
    fails(EX_2_3, nb02.check_stage_loop, answer, says=says)


@pytest.mark.parametrize("answer, name", [(lambda *a: run_program(*a), "run_program"),
                                          (lambda *a: run_threads(*a), "run_threads")])
def test_2_3_library_shortcut_fails(answer, name):
    fails(EX_2_3, nb02.check_stage_loop, answer, globals(), says=f"your code calls `{name}`")


# 2.4 ---------------------------------------------------------------------------------
def peak_held(program, v, frees=("B", "W"), divide=True):
    held, peak = set(), 0
    for a in program:
        if a.kind == "F":
            held.add((a.stage, a.microbatch))
        elif a.kind in frees:
            held.discard((a.stage, a.microbatch))
        peak = max(peak, len(held))
    return peak / v if divide else peak


def forwards_before_first_backward(program, v):
    return next(k for k, a in enumerate(program) if a.kind != "F") / v


def test_2_4_solution_passes():
    passes(EX_2_4, nb02.check_peak_held, peak_held)


@pytest.mark.parametrize("answer", [
    lambda program, v: peak_held(program, v, divide=False),
    lambda program, v: peak_held(program, v, frees=("B", "I")),
    forwards_before_first_backward,
    lambda program, v: sum(a.kind == "F" for a in program) / v,
])
def test_2_4_wrong_answers_fail(answer):
    fails(EX_2_4, nb02.check_peak_held, answer, says="stage-equivalents")


def test_2_4_library_shortcut_fails():
    def by_simulating(program, v):
        p = max(a.stage for a in program) // v + 1
        return max(simulate(interleaved_1f1b(p, 2 * p, v)).peak_in_flight()) / v
    fails(EX_2_4, nb02.check_peak_held, by_simulating, globals(), says="your code calls")


# 2.5 ---------------------------------------------------------------------------------
def interleaved_by_hand(p, m, v, ahead=None, in_rounds=True):
    groups = [range(k, k + p) for k in range(0, m, p)] if in_rounds else [range(m)]
    programs = []
    for r in range(p):
        forwards = [(c * p + r, i) for g in groups for c in range(v) for i in g]
        backwards = [(c * p + r, i) for g in groups for c in reversed(range(v)) for i in g]
        first = (v - 1) * p + 2 * (p - 1 - r) + 1 if ahead is None else ahead(p, m, v, r)
        programs.append(one_forward_one_backward(forwards, backwards, first))
    return Schedule("interleaved by hand", p, m, programs, virtual_stages=v)


def test_2_5_solution_passes():
    passes(EX_2_5, nb02.check_interleaved, interleaved_by_hand)


@pytest.mark.parametrize("answer, says", [
    (lambda p, m, v: interleaved_by_hand(p, m, v, ahead=lambda p, m, v, r: m * v), "peak"),
    (lambda p, m, v: interleaved_by_hand(p, m, v, ahead=lambda p, m, v, r: p - r),
     "not a schedule that can run"),
    (lambda p, m, v: interleaved_by_hand(
        p, m, v, ahead=lambda p, m, v, r: (v - 1) * p + 1), "interleaved 1F1B's"),
    (lambda p, m, v: interleaved_by_hand(p, m, v, in_rounds=False), "not a schedule"),
    (lambda p, m, v: one_f_one_b_by_hand(p, m), "virtual_stages=1"),
    # one hop per later rank, not two: as fast as interleaved 1F1B while messages are free,
    # slower once they take time (the check's simulations give them a time)
    (lambda p, m, v: interleaved_by_hand(
        p, m, v, ahead=lambda p, m, v, r: (v - 1) * p + (p - 1 - r) + 1), "your step takes"),
])
def test_2_5_wrong_answers_fail(answer, says):
    fails(EX_2_5, nb02.check_interleaved, answer, says=says)


def test_2_5_library_shortcut_fails():
    fails(EX_2_5, nb02.check_interleaved, lambda p, m, v: interleaved_1f1b(p, m, v),
          globals(), says="your code calls")
