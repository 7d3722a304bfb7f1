"""The simulator: costs are checked, every action starts exactly when the schedule lets it,
and the per-rank facts (bubble, memory, parameters, messages) count what they say."""
import math

import pytest

from pipeline_lib.schedules import BUILDERS, Action, build, interleaved_1f1b, one_f_one_b, zb_h1, zb_v
from pipeline_lib.timeline import Timeline, rank_facts, simulate


@pytest.mark.parametrize("costs,message", [
    (dict(forward=-1.0), "forward is -1.0: a cost is a duration, a finite number >= 0"),
    (dict(backward=math.nan), "backward is nan"),
    (dict(forward=[1.0, math.inf]), r"forward\[1\] is inf"),
    (dict(weight=[0.5, -0.5]), r"weight\[1\] is -0.5"),
    (dict(comm=-0.1), "comm is -0.1"),
    (dict(backward=2.0, weight=2.5), "weight cost 2.5 of stage 0 exceeds its backward cost 2.0"),
    (dict(backward=[2.0, 1.0], weight=1.5), "weight cost 1.5 of stage 1 exceeds its backward"),
    (dict(forward=[1.0, 2.0, 3.0]), "forward has 3 per-stage costs, expected 2"),
])
def test_bad_costs_are_refused_with_what_was_wrong(costs, message):
    """Negative, NaN or infinite costs, or a W dearer than the whole backward (an I of
    negative cost), gave events that end before they start."""
    with pytest.raises(ValueError, match=message):
        simulate(zb_h1(2, 3), **costs)


def test_costs_must_be_numbers():
    with pytest.raises(TypeError, match="forward must be a number or one number per stage, got '1'"):
        simulate(one_f_one_b(2, 2), forward="1")
    with pytest.raises(TypeError, match=r"backward\[0\] must be a number, got True"):
        simulate(one_f_one_b(2, 2), backward=[True, 2.0])


def test_zero_costs_and_zero_weight_are_allowed():
    t = simulate(zb_h1(2, 2), forward=0.0, backward=1.0, weight=0.0)
    assert all(e.duration == 0.0 for e in t.events if e.action.kind in ("F", "W"))


@pytest.mark.parametrize("name", sorted(BUILDERS))
@pytest.mark.parametrize("comm", [0.0, 0.3])
def test_every_action_starts_as_soon_as_its_rank_and_inputs_are_ready(name, comm):
    """The defining rule, checked exactly: start = max(end of the rank's previous action,
    end of each input + comm if it comes from another rank)."""
    schedule = build(name, 3, 7)
    costs = dict(forward=[1.0, 1.5, 0.5] * (schedule.stages // 3),
                 backward=[2.0, 2.5, 1.5] * (schedule.stages // 3), weight=0.75)
    timeline = simulate(schedule, comm=comm, **costs)
    by_action = {e.action: e for e in timeline.events}
    split = {(a.stage, a.microbatch) for program in schedule.actions for a in program
             if a.kind == "I"}
    for r, program in enumerate(schedule.actions):
        previous_end = 0.0
        for a in program:
            ready = [previous_end]
            s, i = a.stage, a.microbatch
            inputs = {"F": [(s - 1, "F")] if s > 0 else [],
                      "W": [(s, "I")]}.get(a.kind, [(s, "F")] + (
                [(s + 1, "I" if (s + 1, i) in split else "B")] if s < schedule.stages - 1 else []))
            for stage, kind in inputs:
                d = by_action[Action(stage, kind, i)]
                ready.append(d.end + (comm if schedule.rank_of(stage) != r else 0.0))
            assert by_action[a].start == pytest.approx(max(ready)), a
            previous_end = by_action[a].end
    assert [e.start for e in timeline.events] == sorted(e.start for e in timeline.events)


def test_rank_facts_of_1f1b():
    p, m = 4, 8
    schedule = one_f_one_b(p, m)
    facts = rank_facts(schedule, simulate(schedule, forward=1.0, backward=2.0))
    assert [f.bubble for f in facts] == [(p - 1) * 3.0] * p
    assert [f.gaps for f in facts] == [9.0, 6.0, 3.0, 0.0]   # rank r starts r forwards late
    assert [f.activations for f in facts] == [4, 3, 2, 1]
    assert [f.parameters for f in facts] == [1, 1, 1, 1]
    assert [f.messages for f in facts] == [m, 2 * m, 2 * m, m]   # activations + gradients


def test_rank_facts_count_chunks_as_parts_of_a_stage():
    """Two chunks per rank: each holds half a stage, so a micro-batch on one counts ½;
    the V's turn (stages p-1 and p on rank p-1) sends nothing, the loop's sends."""
    p, m = 2, 4
    v = zb_v(p, m)
    facts = rank_facts(v, simulate(v, forward=0.5, backward=1.0))
    assert [f.parameters for f in facts] == [1.0, 1.0]
    assert [f.messages for f in facts] == [2 * m, 2 * m]
    assert max(f.activations for f in facts) == p   # 1F1B's: 2p half-stage micro-batches
    looped = interleaved_1f1b(p, m, 2)
    facts = rank_facts(looped, simulate(looped, forward=0.5, backward=1.0))
    assert [f.messages for f in facts] == [3 * m, 3 * m]


def test_rank_facts_need_the_schedules_ranks():
    schedule = one_f_one_b(2, 2)
    with pytest.raises(ValueError, match="has 4 ranks, the schedule 2"):
        rank_facts(schedule, Timeline(4, simulate(schedule).events))


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_peaks_with_free_actions_follow_each_ranks_order(name):
    """With every cost 0 all events start at 0: the peaks must be those of any positive
    costs (they depend on each rank's order only), not 0 as when releases went first."""
    schedule = build(name, 4, 8)
    free = simulate(schedule, forward=0.0, backward=0.0, weight=0.0)
    assert free.makespan == 0.0
    assert free.peak_in_flight() == simulate(schedule).peak_in_flight()
    assert free.peak_in_flight() != [0] * 4
