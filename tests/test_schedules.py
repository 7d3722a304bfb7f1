"""Schedules: every built-in one is valid; broken ones are rejected with a useful message;
the simulator reproduces the textbook bubble and memory numbers."""
import itertools

import pytest

from pipeline_lib.schedules import (BUILDERS, LOOPED, Action, Schedule, ScheduleError, build,
                                    dependencies, dualpipe_v, gpipe, interleaved_1f1b,
                                    one_f_one_b, plan, rounds, splits_backward, v_shape,
                                    validate, zb_h1, zb_v)
from pipeline_lib.timeline import bubble_theory, simulate

# Every builder, on 1-5 ranks, with micro-batch counts below, at and above the ranks and
# stages, multiples or not; looped ones with 1-3 chunks per rank. Built inside the test.
SIZES = [(name, p, m, v) for name in BUILDERS for p, m in itertools.product(range(1, 6), range(1, 12))
         for v in ((1, 2, 3) if name in LOOPED else (2,))]


@pytest.mark.parametrize("name,p,m,v", SIZES, ids=lambda x: str(x))
def test_builtin_schedules_are_valid_and_simulate_respecting_dependencies(name, p, m, v):
    schedule = build(name, p, m, v)
    assert (schedule.ranks, schedule.microbatches) == (p, m)
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


@pytest.mark.parametrize("p,m", [(4, 6), (4, 9), (3, 7), (2, 5), (4, 3), (4, 1)])
def test_interleaved_runs_any_number_of_microbatches_in_rounds(p, m):
    """PyTorch's rounds: max(1, m // p) groups, which run chunk by chunk; where PyTorch
    needs m divisible by them, the first groups take one more. From m = p on, the bubble
    is the formula's, multiple of p or not."""
    groups = rounds(p, m)
    assert [i for g in groups for i in g] == list(range(m))
    assert len(groups) == max(1, m // p) and max(map(len, groups)) - min(map(len, groups)) <= 1
    t = simulate(interleaved_1f1b(p, m, 2), forward=0.5, backward=1.0)
    if m >= p:
        assert t.bubble_fraction() == pytest.approx(bubble_theory(p, m, 2))


def test_build_by_name():
    assert build("1f1b", 2, 4).actions == one_f_one_b(2, 4).actions
    assert build("interleaved_1f1b", 2, 4, 3).actions == interleaved_1f1b(2, 4, 3).actions
    assert build("zb_v", 2, 4).actions == zb_v(2, 4).actions
    with pytest.raises(ValueError, match="unknown schedule 'pipedream'"):
        build("pipedream", 2, 4)


def test_v_shaped_schedules_place_stages_down_and_back_up():
    s = zb_v(3, 6)
    assert v_shape(3) == (0, 1, 2, 2, 1, 0)
    assert [s.rank_of(stage) for stage in range(6)] == [0, 1, 2, 2, 1, 0]
    assert s.stages_on(0) == [0, 5] and s.stages_on(2) == [2, 3]
    assert {a.stage for a in s.actions[1]} == {1, 4}
    assert one_f_one_b(3, 6).rank_of(2) == 2 and interleaved_1f1b(3, 6).rank_of(4) == 1


def test_plan_builds_v_shaped_schedules_with_two_stages_per_rank():
    assert plan("dualpipe_v", 2, 4, 4).placement == (0, 1, 1, 0)
    with pytest.raises(ValueError, match=r"zb_v runs 2 stage\(s\) per rank: .* give 4 entries"):
        plan("zb_v", 2, 2, 4)
    with pytest.raises(TypeError, match="a name in .* or a Schedule, got NoneType"):
        plan(None, 2, 2, 4)


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


def test_placement_must_name_a_rank_for_every_stage():
    s = zb_v(2, 2)
    s.placement = (0, 1, 1)
    with pytest.raises(ScheduleError, match=r"placement \[0, 1, 1\] must give a rank in "
                                            r"0..1 for each of the 4 stages"):
        validate(s)
    s.placement = (0, 0, 0, 0)
    with pytest.raises(ScheduleError, match=r"gives no stage to ranks \[1\]"):
        validate(s)
    s = zb_v(2, 2)
    s.placement = None   # looped: stage 3 would live on rank 1, but rank 0 runs it
    with pytest.raises(ScheduleError, match="rank 0 step .*: 3F0 belongs to stage 3, which "
                                            "lives on rank 1"):
        validate(s)


def test_a_backward_may_be_split_for_some_microbatches_but_not_twice_for_one():
    """DualPipeV runs full backwards in its steady state and split ones at the end: what
    the next stage waits for is then the B or the I of that micro-batch."""
    s = dualpipe_v(2, 4)
    split = splits_backward(s)
    assert split and len(split) < s.stages * s.microbatches
    validate(s)
    assert dependencies(Action(0, "B", 0), 4, {(1, 0)}) == [Action(0, "F", 0), Action(1, "I", 0)]
    assert dependencies(Action(0, "B", 0), 4, set()) == [Action(0, "F", 0), Action(1, "B", 0)]
    stage, i = next(iter(split))
    s.actions[s.rank_of(stage)].append(Action(stage, "B", i))
    with pytest.raises(ScheduleError, match=f"mixes a full backward B with split I/W "
                                            f"backwards of the same micro-batch {i}"):
        validate(s)
    s = zb_h1(2, 2)
    s.actions[1].remove(Action(1, "W", 1))
    with pytest.raises(ScheduleError, match="stage 1 never runs W of micro-batch 1"):
        validate(s)


def test_1f1b_closed_form_holds_on_a_large_pipeline():
    """bench/bench_simulate.py times this size and larger ones."""
    schedule = one_f_one_b(32, 400)
    validate(schedule)
    assert simulate(schedule).makespan == 3 * (400 + 31)


@pytest.mark.parametrize("sizes, message", [
    (dict(ranks=0), "ranks is 0; a schedule needs at least 1"),
    (dict(microbatches=0), "microbatches is 0; a schedule needs at least 1"),
    (dict(virtual_stages=0), "virtual_stages is 0; a schedule needs at least 1"),
    (dict(ranks=2.0), "ranks is 2.0; a schedule needs at least 1 \\(an int\\)"),
])
def test_a_schedule_with_nothing_to_run_is_refused(sizes, message):
    """Zero ranks, micro-batches or stages per rank validated (and simulated as an empty
    step) instead of being named as the mistake they are."""
    base = dict(ranks=1, microbatches=1, virtual_stages=1)
    base.update(sizes)
    actions = [[] for _ in range(int(base["ranks"]))]
    s = Schedule("empty", base["ranks"], base["microbatches"], actions, base["virtual_stages"])
    with pytest.raises(ScheduleError, match=message):
        validate(s)
    with pytest.raises(ScheduleError, match=message):
        simulate(s)


@pytest.mark.parametrize("step, message", [
    ((0, "F", 0), r"rank 0 step 0: \(0, 'F', 0\) is a tuple, not an Action; write each step "
                  r"as Action\(stage, kind, microbatch\)"),
    (Action("0", "F", 0), r"rank 0 step 0: .* has stage '0' and micro-batch 0; both must be "
                          r"ints"),
])
def test_a_step_that_is_not_an_action_of_ints_is_named(step, message):
    s = gpipe(1, 1)
    s.actions[0][0] = step
    with pytest.raises(ScheduleError, match=message):
        validate(s)


def test_simulate_validates_the_placement_before_reading_it():
    s = zb_v(2, 2)
    s.placement = (0, 1)                         # 2 entries for 4 stages: was an IndexError
    with pytest.raises(ScheduleError, match=r"placement \[0, 1\] must give a rank"):
        simulate(s)


def test_what_is_not_a_schedule_is_named():
    """A schedule's name where a Schedule is expected gave AttributeError: 'str' object
    has no attribute 'ranks'."""
    for call in (validate, simulate):
        with pytest.raises(TypeError, match=r"expected a Schedule, got str; build one by "
                                            r"name with build\(name, ranks, microbatches\)"):
            call("gpipe")
    with pytest.raises(TypeError, match="ranks and microbatches must be ints"):
        build("gpipe", True, 4)                    # was a GPipe of True ranks
    with pytest.raises(ValueError, match="bubble_theory needs ranks, microbatches and "
                                         "virtual_stages >= 1, got 1, 0 and 1"):
        bubble_theory(1, 0)                        # was ZeroDivisionError
