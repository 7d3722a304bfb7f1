"""Schedules: every built-in one is valid; broken ones are rejected with a useful message;
the simulator reproduces the textbook bubble and memory numbers."""
import itertools

import pytest

from pipeline_lib.schedules import (Action, Schedule, ScheduleError, build, dependencies,
                                    gpipe, interleaved_1f1b, one_f_one_b, splits_backward,
                                    validate, zb_h1)
from pipeline_lib.timeline import bubble_theory, simulate


def all_schedules():
    for p, m in itertools.product(range(1, 5), range(1, 9)):
        yield gpipe(p, m)
        yield one_f_one_b(p, m)
        yield zb_h1(p, m)
        if m % p == 0:
            for v in (2, 3):
                yield interleaved_1f1b(p, m, v)


@pytest.mark.parametrize("schedule", list(all_schedules()), ids=lambda s: f"{s.name}-p{s.ranks}-m{s.microbatches}")
def test_builtin_schedules_are_valid_and_simulate_respecting_dependencies(schedule):
    validate(schedule)
    timeline = simulate(schedule)
    end = {e.action: e.end for e in timeline.events}
    start = {e.action: e.start for e in timeline.events}
    split = splits_backward(schedule)
    for a in start:
        for d in dependencies(a, schedule.stages, split):
            assert start[a] >= end[d], f"{a} started before {d} finished"
    # each rank runs its program in order, one action at a time
    for r in range(schedule.ranks):
        mine = sorted((e for e in timeline.events if e.rank == r), key=lambda e: e.start)
        assert [e.action for e in mine] == schedule.actions[r]
        assert all(x.end <= y.start for x, y in zip(mine, mine[1:]))


def test_action_string_and_grid():
    assert str(Action(0, "F", 1)) == "0F1"
    grid = one_f_one_b(2, 2).grid()
    assert grid.splitlines()[0].split() == ["rank", "0:", "0F0", "0F1", "0B0", "0B1"]
    assert grid.splitlines()[1].split() == ["rank", "1:", "1F0", "1B0", "1F1", "1B1"]


@pytest.mark.parametrize("p,m", [(p, m) for p in range(1, 6) for m in range(1, 13)])
def test_gpipe_and_1f1b_bubble_and_memory(p, m):
    for schedule in (gpipe(p, m), one_f_one_b(p, m)):
        t = simulate(schedule, forward=1.0, backward=2.0)
        assert t.bubble_fraction() == pytest.approx((p - 1) / (m + p - 1))
        assert t.makespan == pytest.approx(3 * (m + p - 1))
    assert simulate(gpipe(p, m)).peak_in_flight() == [m] * p
    assert simulate(one_f_one_b(p, m)).peak_in_flight() == [min(p - s, m) for s in range(p)]


@pytest.mark.parametrize("p,m,v", [(2, 4, 2), (4, 8, 2), (4, 8, 4), (3, 9, 3), (2, 8, 2)])
def test_interleaving_divides_the_bubble_by_v(p, m, v):
    """Each rank's share of a micro-batch shrinks to 1/v, so the fill and drain, (p-1)
    chunk-steps long, cost 1/v as much; the useful work does not change. Relative to the
    ideal time: (p-1)/(v·m) instead of (p-1)/m, a factor v."""
    plain = simulate(one_f_one_b(p, m), forward=1.0, backward=2.0)
    inter = simulate(interleaved_1f1b(p, m, v), forward=1.0 / v, backward=2.0 / v)
    assert inter.bubble_fraction() == pytest.approx(bubble_theory(p, m, v))
    assert inter.bubble_fraction() < plain.bubble_fraction()
    ideal = 3.0 * m
    assert (plain.makespan - ideal) / (inter.makespan - ideal) == pytest.approx(v)


@pytest.mark.parametrize("p,m", [(2, 2), (2, 4), (3, 3), (3, 8), (4, 4), (4, 8), (4, 16)])
def test_zb_h1_smaller_bubble_same_peak_memory(p, m):
    zb = simulate(zb_h1(p, m))               # F = I = W = 1, B = I + W = 2
    base = simulate(one_f_one_b(p, m))
    assert zb.bubble_fraction() < base.bubble_fraction()
    assert max(zb.peak_in_flight()) == max(base.peak_in_flight())
    # the paper's count: bubble (p-1)(F + I - W) instead of (p-1)(F + B)
    assert zb.makespan == pytest.approx(3 * m + (p - 1) * 1)


def test_interleaved_needs_a_multiple_of_ranks():
    with pytest.raises(ValueError, match="not a multiple of 4"):
        interleaved_1f1b(4, 6, 2)


def test_build_by_name():
    assert build("1f1b", 2, 4).actions == one_f_one_b(2, 4).actions
    with pytest.raises(ValueError, match="unknown schedule 'pipedream'"):
        build("pipedream", 2, 4)


def _broken(actions, ranks=2, m=2):
    return Schedule("broken", ranks, m, actions)


def test_backward_before_its_forward_is_rejected():
    s = one_f_one_b(2, 2)
    s.actions[0][0], s.actions[0][2] = s.actions[0][2], s.actions[0][0]  # 0B0 first
    with pytest.raises(ScheduleError, match=r"rank 0 step 0: 0B0 \(micro-batch 0, stage 0\)"):
        validate(s)


def test_crosswise_wait_is_reported_as_deadlock():
    F, B = "F", "B"
    s = _broken([[Action(0, F, 0), Action(0, F, 1), Action(0, B, 1), Action(0, B, 0)],
                 [Action(1, F, 0), Action(1, B, 0), Action(1, F, 1), Action(1, B, 1)]])
    validate(s)  # different orders are fine as long as nothing waits in a circle
    s = _broken([[Action(0, F, 0), Action(0, B, 0), Action(0, F, 1), Action(0, B, 1)],
                 [Action(1, F, 1), Action(1, F, 0), Action(1, B, 0), Action(1, B, 1)]])
    with pytest.raises(ScheduleError, match="deadlock") as err:
        validate(s)
    message = str(err.value)
    assert "rank 0 step 1: 0B0" in message and "waits for 1B0" in message
    assert "rank 1 step 0: 1F1" in message and "waits for 0F1" in message


def test_missing_duplicate_and_misplaced_actions_are_named():
    s = gpipe(2, 2)
    s.actions[1].remove(Action(1, "B", 1))
    with pytest.raises(ScheduleError, match=r"stage 1 never runs B of micro-batch 1"):
        validate(s)
    s = gpipe(2, 2)
    s.actions[0].append(Action(0, "F", 1))
    with pytest.raises(ScheduleError, match=r"rank 0 step 4: 0F1 .* appears twice"):
        validate(s)
    s = gpipe(2, 2)
    s.actions[0][0] = Action(1, "F", 0)
    with pytest.raises(ScheduleError, match=r"rank 0 step 0: 1F0 belongs to stage 1, which "
                                            r"lives on rank 1"):
        validate(s)
    s = zb_h1(2, 2)
    s.actions[0].append(Action(0, "B", 0))
    with pytest.raises(ScheduleError, match="mixes a full backward"):
        validate(s)


def test_weight_gradient_before_input_gradient_is_rejected():
    s = zb_h1(2, 2)
    program = s.actions[1]
    i, w = program.index(Action(1, "I", 0)), program.index(Action(1, "W", 0))
    program[i], program[w] = program[w], program[i]
    with pytest.raises(ScheduleError, match=r"1W0 .* waits for 1I0"):
        validate(s)
