"""Notebook 02's exercise checks: the solution passes; plausible wrong answers, and the
library function that is the answer, each fail with the exercise's own message."""
from __future__ import annotations


import pytest

from pipeline_lib.course.checks import nb02
from pipeline_lib.executor import run_program
from pipeline_lib.schedules import (BUILDERS, Action, Schedule, build, gpipe,
                                    interleaved_1f1b, one_f_one_b, one_forward_one_backward)
from pipeline_lib import schedules
from pipeline_lib.threaded.threads import run_threads
from pipeline_lib.timeline import Event, Timeline, simulate
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


def backwards_reversed_per_rank(stages, microbatches):   # GPipe, each rank's backwards last first
    programs = [[Action(s, "F", i) for i in range(microbatches)]
                + [Action(s, "B", i) for i in reversed(range(microbatches))]
                for s in range(stages)]
    return Schedule("GPipe, backwards reversed", stages, microbatches, programs)


def every_rank_stage_zero(stages, microbatches):         # rank r holds stage r: not 0
    return Schedule("x", stages, microbatches,
                    [[Action(0, k, i) for k in "FB" for i in range(microbatches)]
                     for _ in range(stages)])


def microbatches_from_one(stages, microbatches):         # 1..m, not 0..m-1
    return Schedule("x", stages, microbatches,
                    [[Action(s, k, i) for k in "FB" for i in range(1, microbatches + 1)]
                     for s in range(stages)])


def gpipe_table(stages, microbatches):                   # the shown sizes only
    assert (stages, microbatches) in {(1, 1), (2, 3), (3, 4), (4, 8)}, "not in my table"
    return gpipe_by_hand(stages, microbatches)


def test_2_1_solution_passes():
    passes(EX_2_1, nb02.check_gpipe, gpipe_by_hand)


def test_2_1_right_answer_written_another_way_passes():
    passes(EX_2_1, nb02.check_gpipe, backwards_reversed_per_rank)   # torchgpipe's order


def test_2_1_a_table_of_the_shown_sizes_fails_on_the_drawn_ones():
    fails(EX_2_1, nb02.check_gpipe, gpipe_table, says="not in my table")


@pytest.mark.parametrize("answer, says", [
    (lambda p, m: one_f_one_b_by_hand(p, m), "peak in-flight"),
    (one_at_a_time, "simulated bubble"),
    (forwards_only, "not a schedule that can run"),
    (sizes_swapped, "expected"),
    (every_rank_stage_zero, "not a schedule that can run"),
    (microbatches_from_one, "not a schedule that can run"),
])
def test_2_1_wrong_answers_fail(answer, says):
    fails(EX_2_1, nb02.check_gpipe, answer, says=says)


def gpipe_captured(p, m, _build=gpipe):
    return _build(p, m)


@pytest.mark.parametrize("answer", [
    lambda p, m: gpipe(p, m), lambda p, m: build("gpipe", p, m),
    lambda p, m: BUILDERS["gpipe"](p, m),                 # the issue's: the builders' dict
    lambda p, m: schedules.gpipe(p, m), gpipe_captured,
])
def test_2_1_library_shortcut_fails(answer):
    fails(EX_2_1, nb02.check_gpipe, answer, says="your code calls")


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


def backwards_newest_first(stages, microbatches):        # B of the newest micro-batch first
    p, m = stages, microbatches
    programs = []
    for s in range(p):
        ahead = min(p - s, m)
        program, held, nxt = [Action(s, "F", i) for i in range(ahead)], list(range(ahead)), ahead
        while held:
            program.append(Action(s, "B", held.pop()))
            if nxt < m:
                program.append(Action(s, "F", nxt))
                held.append(nxt)
                nxt += 1
        programs.append(program)
    return Schedule("x", p, m, programs)


def test_2_2_solution_passes():
    passes(EX_2_2, nb02.check_one_f_one_b, one_f_one_b_by_hand)


def test_2_2_right_answer_from_the_warm_up_passes():   # p - 1 - s forwards, then F B pairs
    def warm_up_then_pairs(p, m):
        programs = []
        for s in range(p):
            warm = min(p - 1 - s, m)
            program = [Action(s, "F", i) for i in range(warm)]
            for i in range(m):
                if warm + i < m:
                    program.append(Action(s, "F", warm + i))
                program.append(Action(s, "B", i))
            programs.append(program)
        return Schedule("mine", p, m, programs)
    passes(EX_2_2, nb02.check_one_f_one_b, warm_up_then_pairs)


@pytest.mark.parametrize("answer, says", [
    (lambda p, m: one_f_one_b_by_hand(p, m, lambda p, s: p - 1 - s), "not a schedule"),
    (lambda p, m: one_f_one_b_by_hand(p, m, lambda p, s: p), "simulated bubble"),
    (lambda p, m: one_f_one_b_by_hand(p, m, lambda p, s: 1), "simulated bubble"),
    (gpipe_by_hand, "1F1B holds"),
    (backwards_newest_first, "simulated bubble"),
    (lambda p, m: one_f_one_b_by_hand(p, m, lambda p, s: p - s + 1), "1F1B holds"),
    (lambda p, m: one_f_one_b_by_hand(p, m, lambda p, s: s + 1), "not a schedule"),
])
def test_2_2_wrong_answers_fail(answer, says):
    fails(EX_2_2, nb02.check_one_f_one_b, answer, says=says)


@pytest.mark.parametrize("answer", [
    lambda p, m: one_f_one_b(p, m),
    lambda p, m: BUILDERS["1f1b"](p, m),
    lambda p, m, _b=one_f_one_b: _b(p, m),
    lambda p, m: Schedule("x", p, m, [one_forward_one_backward(
        [(s, i) for i in range(m)], [(s, i) for i in range(m)], p - s) for s in range(p)]),
])
def test_2_2_library_shortcut_fails(answer):
    fails(EX_2_2, nb02.check_one_f_one_b, answer, says="your code calls")


# 2.3 ---------------------------------------------------------------------------------
def stage_loop(runner, program, mail, stages, inputs, targets, order=None, as_b=False,
               keep_w=False, back=-1, sent=lambda t: t, returned=lambda g: g,
               key=lambda *k: k):
    """The solution, with switches for the usual mistakes: another order, I run as B
    (its W skipped, or run too: ``keep_w``), the input gradient sent to another
    stage (``back``), an activation or a gradient changed on its way (``sent``,
    ``returned``), keys that do not say what a message is or who gets it (``key``)."""
    for s, kind, i in (order(program) if order else program):
        if kind == "F":
            x = inputs[i] if s == 0 else mail.get(key("activation", s, i))
            y = runner.forward(i, x, targets[i] if s == stages - 1 else None)
            if s < stages - 1:
                mail.put(key("activation", s + 1, i), sent(y))
        elif kind == "W":
            if keep_w or not as_b:
                runner.backward_weight(i)
        else:
            grad = None if s == stages - 1 else mail.get(key("gradient", s, i))
            backward = runner.backward if kind == "B" or as_b else runner.backward_input
            grad_in = backward(i, grad)
            if s > 0:
                mail.put(key("gradient", s + back, i), returned(grad_in))


def forwards_then_backwards(program):        # ignores the program's order
    return sorted(program, key=lambda a: (a.kind != "F", a.kind == "W"))


def test_2_3_solution_passes():
    passes(EX_2_3, nb02.check_stage_loop, stage_loop)


@pytest.mark.parametrize("answer, says", [
    (lambda *a: stage_loop(*a, order=forwards_then_backwards), "but its program is"),
    (lambda *a: stage_loop(*a, as_b=True), "but its program is"),
    (lambda *a: stage_loop(*a, order=lambda program: program[:-1]), "but its program is"),
    (lambda r, program, *a: None, "computed no loss"),
    (lambda *a: stage_loop(*a, order=lambda program: [x for x in program if x.kind != "W"]),
     "but its program is"),                               # the Ws dropped
    (lambda *a: stage_loop(*a, back=+1), "TimeoutError"),     # the gradient sent to s + 1
    (lambda *a: stage_loop(*a, as_b=True, keep_w=True),    # then its W: nothing to finish
     "without its I (was I run as a whole B?)"),
    (lambda *a: stage_loop(*a, key=lambda kind, s, i: i),     # one key for both directions
     "another stage took it: keys must name the receiving stage"),
    (lambda *a: stage_loop(*a, returned=lambda g: g * 0), "gradient differs"),
    (lambda *a: stage_loop(*a, sent=lambda t: t * 2), "the loss is"),
])
def test_2_3_wrong_answers_fail(answer, says):
    fails(EX_2_3, nb02.check_stage_loop, answer, says=says)


@pytest.mark.parametrize("answer, name", [(lambda *a: run_program(*a), "run_program"),
                                          (lambda *a: run_threads(*a), "run_threads")])
def test_2_3_library_shortcut_fails(answer, name):
    fails(EX_2_3, nb02.check_stage_loop, answer, says=f"your code calls `{name}`")


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


def peak_table(program, v):                    # rank 0's peaks of the shown schedules
    return {(8, 2): 5.5, (6, 2): 6.0, (6, 3): 4.0 + 2 / 3}[len(program) // 4, v]


def test_2_4_solution_passes():
    passes(EX_2_4, nb02.check_peak_held, peak_held)


@pytest.mark.parametrize("answer", [
    lambda program, v: peak_held(program, v, divide=False),
    lambda program, v: peak_held(program, v, frees=("B", "I")),
    forwards_before_first_backward,
    lambda program, v: sum(a.kind == "F" for a in program) / v,
    lambda program, v: peak_held(program, v, frees=("B", "I", "W")),   # an I frees them
    lambda program, v: peak_held(program, 1),                           # v ignored
    peak_table,
])
def test_2_4_wrong_answers_fail(answer):
    message = fails(EX_2_4, nb02.check_peak_held, answer, says="peak_held gives")
    assert "than the simulator's" in message or "KeyError" in message, message



def test_2_4_library_shortcut_fails():
    def by_simulating(program, v):
        p = max(a.stage for a in program) // v + 1
        return max(simulate(interleaved_1f1b(p, 2 * p, v)).peak_in_flight()) / v
    fails(EX_2_4, nb02.check_peak_held, by_simulating, says="your code calls")
    fails(EX_2_4, nb02.check_peak_held, lambda program, v, _s=simulate: by_simulating(
        program, v), says="your code calls")


def as_timeline(program):                      # the program, one unit per action, on rank 0
    return Timeline(1, [Event(0, a, k, k + 1) for k, a in enumerate(program)])


@pytest.mark.parametrize("answer", [          # the simulator's counters, without simulate
    lambda program, v: as_timeline(program).peak_in_flight()[0] / v,
    lambda program, v: as_timeline(program).peak_activations(
        [1 / v] * (max(a.stage for a in program) + 1))[0],
])
def test_2_4_timeline_shortcut_fails(answer):
    fails(EX_2_4, nb02.check_peak_held, answer, says="your code calls")


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


def interleaved_reversed_stages(p, m, v):      # forwards through the last virtual stage first
    groups = [range(k, k + p) for k in range(0, m, p)]
    programs = []
    for r in range(p):
        forwards = [(c * p + r, i) for g in groups for c in reversed(range(v)) for i in g]
        backwards = [(c * p + r, i) for g in groups for c in range(v) for i in g]
        programs.append(one_forward_one_backward(forwards, backwards,
                                                 (v - 1) * p + 2 * (p - 1 - r) + 1))
    return Schedule("x", p, m, programs, virtual_stages=v)


def interleaved_for_two_ranks_only(p, m, v):   # right at the shown sizes only
    assert (p, m, v) in nb02.INTERLEAVED_CASES, "two ranks only"
    return interleaved_by_hand(p, m, v)


def test_2_5_solution_passes():
    passes(EX_2_5, nb02.check_interleaved, interleaved_by_hand)


@pytest.mark.parametrize("answer, says", [
    (lambda p, m, v: interleaved_by_hand(p, m, v, ahead=lambda p, m, v, r: m * v),
     "more than under interleaved 1F1B on ranks"),
    (lambda p, m, v: interleaved_by_hand(p, m, v, ahead=lambda p, m, v, r: p - r),
     "not a schedule that can run"),
    (lambda p, m, v: interleaved_by_hand(
        p, m, v, ahead=lambda p, m, v, r: (v - 1) * p + 1), "count the hops"),
    (lambda p, m, v: interleaved_by_hand(p, m, v, in_rounds=False), "not a schedule"),
    (lambda p, m, v: one_f_one_b_by_hand(p, m), "virtual_stages=1"),
    # one hop per later rank, not two: as fast as interleaved 1F1B while messages are free,
    # slower once they take time (the check's simulations give them a time)
    (lambda p, m, v: interleaved_by_hand(
        p, m, v, ahead=lambda p, m, v, r: (v - 1) * p + (p - 1 - r) + 1), "your step takes"),
    (lambda p, m, v: interleaved_by_hand(p, m, v, ahead=lambda p, m, v, r: v * p),
     "more than under interleaved 1F1B on ranks"),
    (interleaved_reversed_stages, "not a schedule"),
    (interleaved_for_two_ranks_only, "two ranks only"),
])
def test_2_5_wrong_answers_fail(answer, says):
    fails(EX_2_5, nb02.check_interleaved, answer, says=says)


def test_2_5_memory_message_gives_only_the_learners_peaks():
    """The target's peaks are the warm-up counts the exercise asks for: not printed."""
    message = fails(EX_2_5, nb02.check_interleaved, lambda p, m, v: interleaved_by_hand(
        p, m, v, ahead=lambda p, m, v, r: m * v), says="more than under interleaved 1F1B")
    assert str(simulate(interleaved_1f1b(2, 4, 2)).peak_in_flight()) not in message, message


@pytest.mark.parametrize("answer", [
    lambda p, m, v: interleaved_1f1b(p, m, v),
    lambda p, m, v: BUILDERS["interleaved_1f1b"](p, m, v),
    lambda p, m, v, _b=build: _b("interleaved_1f1b", p, m, v),
])
def test_2_5_library_shortcut_fails(answer):
    fails(EX_2_5, nb02.check_interleaved, answer, says="your code calls")


# the check's mailbox ---------------------------------------------------------------------
def test_mail_reports_a_deadlock_at_once_and_waits_for_a_slow_sender():
    """A message no stage can send any more is an error as soon as every stage waits (not
    after a patience a loaded machine could exceed); a slow sender is waited for."""
    import threading
    import time

    mail, raised = nb02.Mail(2, patience=60), []

    def waits(key):
        try:
            mail.get(key)
        except TimeoutError as error:
            raised.append(str(error))
        finally:
            mail.finished()
    started = time.monotonic()
    threads = [threading.Thread(target=waits, args=(k,)) for k in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert time.monotonic() - started < 10 and len(raised) == 2
    assert "'a'" in "".join(raised) and "will never come" in raised[0]
    assert "keys must name the receiving stage" in raised[0]     # or another stage took it

    mail, got = nb02.Mail(2, patience=60), []
    receiver = threading.Thread(target=lambda: got.append(mail.get("x")))
    receiver.start()
    time.sleep(0.5)                   # the sender computes: the receiver keeps waiting
    mail.put("x", 42)
    receiver.join()
    assert got == [42]
