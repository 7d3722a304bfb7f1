"""timeline.py: the simulator's times worked out by hand for non-zero ``comm``, split
backwards with their own ``weight`` and per-stage costs; per-rank peaks and bubbles, not
only their maxima.

Written against the mutants `make mutants` found alive (see mutants-equivalent.md).
"""
import pytest

from pipeline_lib.schedules import (Action, build, gpipe, interleaved_1f1b, one_f_one_b,
                                    zb_h1)
from pipeline_lib.timeline import (Event, Timeline, bubble_theory, rank_facts, simulate,
                                   simulate_measured, summary)


def times(timeline):
    return {str(e.action): (e.start, e.end) for e in timeline.events}


def test_gpipe_with_comm_and_per_stage_costs_by_hand():
    t = simulate(gpipe(2, 2), forward=[1.0, 2.0], backward=[3.0, 4.0], comm=0.5)
    assert times(t) == {
        "0F0": (0.0, 1.0), "0F1": (1.0, 2.0),
        "1F0": (1.5, 3.5),                    # 0F0's output arrives comm = 0.5 later
        "1F1": (3.5, 5.5),                    # rank 1 busy until 3.5 (input came at 2.5)
        "1B0": (5.5, 9.5), "1B1": (9.5, 13.5),
        "0B0": (10.0, 13.0),                  # the gradient of 1B0 arrives at 9.5 + 0.5
        "0B1": (14.0, 17.0),
    }
    assert t.makespan == 17.0
    assert t.busy() == [8.0, 12.0]            # per rank: m · (f_s + b_s)
    assert t.bubble_fraction() == pytest.approx(1 - 20 / 34)
    assert [f.bubble for f in rank_facts(gpipe(2, 2), t)] == [9.0, 5.0]
    assert [f.gaps for f in rank_facts(gpipe(2, 2), t)] == [9.0, 0.0]  # rank 1 never waits


def test_split_backward_with_its_own_weight_cost_by_hand():
    # I costs backward - weight, W costs weight, per stage.
    t = simulate(zb_h1(2, 1), forward=1.0, backward=[2.0, 3.0], weight=[0.5, 1.0], comm=0.25)
    assert times(t) == {
        "0F0": (0.0, 1.0), "1F0": (1.25, 2.25),
        "1I0": (2.25, 4.25), "1W0": (4.25, 5.25),
        "0I0": (4.5, 6.0),                    # 1I0's gradient arrives at 4.25 + 0.25
        "0W0": (6.0, 6.5),
    }
    # Without weight=, W is half the backward: the I and W of stage 1 cost 1.5 each.
    t = simulate(zb_h1(2, 1), forward=1.0, backward=[2.0, 3.0])
    assert times(t)["1I0"] == (2.0, 3.5) and times(t)["1W0"] == (3.5, 5.0)
    assert times(t)["0I0"] == (3.5, 4.5) and times(t)["0W0"] == (4.5, 5.5)


def test_comm_is_paid_only_between_ranks():
    # Interleaved: stage 2 lives on rank 0 like stage 0, so 1F0 -> 2F0 crosses ranks but
    # 2F0's own rank ran 0F0; the last stage's backward starts right after its forward.
    t = simulate(interleaved_1f1b(2, 2, 2), forward=1.0, backward=1.0, comm=10.0)
    start = {str(e.action): e.start for e in t.events}
    assert start["1F0"] == 11.0 and start["2F0"] == 22.0 and start["3F0"] == 33.0
    assert start["3B0"] == 34.0               # same rank and stage: no message


@pytest.mark.parametrize("p, m", [(2, 4), (4, 4), (4, 8), (3, 7)])
def test_zb_h1_holds_p_microbatches_on_every_stage(p, m):
    # Stage s keeps p - s forwards ahead and runs each W s backwards late: p held per stage
    # (1F1B's stage 0 peak, now on every stage), as the docstring says.
    assert simulate(zb_h1(p, m)).peak_in_flight() == [min(p, m)] * p
    assert simulate(one_f_one_b(p, m)).peak_in_flight() == [min(p - s, m) for s in range(p)]


@pytest.mark.parametrize("p, m, v", [(4, 8, 2), (4, 16, 2), (2, 4, 3), (3, 6, 2)])
def test_interleaved_1f1b_peaks_per_rank(p, m, v):
    # Rank r runs a whole round (p micro-batches) through v - 1 chunks and 2(p - 1 - r) + 1
    # forwards more before its first backward: that many micro-batch-chunks held.
    peaks = simulate(interleaved_1f1b(p, m, v)).peak_in_flight()
    assert peaks == [(v - 1) * p + 2 * (p - 1 - r) + 1 for r in range(p)]


def test_interleaved_1f1b_peaks_example_from_the_issue():
    assert simulate(interleaved_1f1b(4, 8, 2)).peak_in_flight() == [11, 9, 7, 5]


def test_peak_activations_weigh_each_stage():
    t = simulate(one_f_one_b(2, 4))
    assert t.peak_activations() == [2.0, 1.0]
    assert t.peak_activations([0.5, 3.0]) == [1.0, 3.0]


def test_a_microbatch_is_held_until_its_last_backward_action():
    # Hand-made timeline on one rank: micro-batch 0 from 0 to its W at 5; micro-batch 1
    # from 1 to its I at 4 (no W recorded: held until the I).
    events = [Event(0, Action(0, "F", 0), 0, 1), Event(0, Action(0, "F", 1), 1, 2),
              Event(0, Action(0, "I", 0), 2, 3), Event(0, Action(0, "I", 1), 3, 4),
              Event(0, Action(0, "W", 0), 4, 5), Event(0, Action(0, "F", 2), 4.5, 6)]
    assert Timeline(1, events).peak_in_flight() == [2]
    # Released at the same time as another is taken: the release goes first.
    events = [Event(0, Action(0, "F", 0), 0, 1), Event(0, Action(0, "B", 0), 1, 2),
              Event(0, Action(0, "F", 1), 2, 3), Event(0, Action(0, "B", 1), 3, 4)]
    assert Timeline(1, events).peak_in_flight() == [1]
    # A forward with no backward yet is held to the end.
    assert Timeline(1, events[:3]).peak_in_flight() == [1]
    assert Timeline(2, events[:1]).peak_in_flight() == [1, 0]


def test_bubble_and_makespan_of_a_measured_timeline():
    events = [Event(0, Action(0, "F", 0), 10.0, 11.0), Event(1, Action(1, "F", 0), 12.0, 14.0)]
    t = Timeline(2, events)
    assert t.makespan == 4.0
    assert t.busy() == [1.0, 2.0]
    assert t.bubble_fraction() == pytest.approx(1 - 3 / 8)
    assert Timeline(2).makespan == 0.0 and Timeline(2).bubble_fraction() == 0.0
    shifted = t.shifted()
    assert [(e.start, e.end) for e in shifted.events] == [(0.0, 1.0), (2.0, 4.0)]
    assert (shifted.ranks, shifted.unit, shifted.title) == (2, t.unit, t.title)


def test_timeline_round_trips_through_a_dict():
    t = simulate(zb_h1(2, 2), forward=[1.0, 2.0], comm=0.5)
    t.title = "zb"
    data = t.to_dict()
    assert data["events"][0] == {"rank": 0, "start": 0.0, "end": 1.0, "stage": 0,
                                 "kind": "F", "microbatch": 0}
    back = Timeline.from_dict(data)
    assert (back.ranks, back.unit, back.title, back.events) == (2, "", "zb", t.events)
    plain = Timeline.from_dict({"ranks": 1, "events": []})
    assert (plain.unit, plain.title) == ("s", "")


def test_bubble_theory():
    assert bubble_theory(4, 8) == pytest.approx(3 / 11)
    assert bubble_theory(4, 8, 2) == pytest.approx(3 / 19)
    assert bubble_theory(1, 5) == 0.0


@pytest.mark.parametrize("name", ["1f1b", "zb_h1"])
def test_simulate_measured_uses_each_stages_mean_times(name):
    schedule = build(name, 2, 3)
    costs = dict(forward=[1.0, 2.0], backward=[3.0, 5.0], weight=[1.0, 2.0])
    measured = simulate(schedule, **costs)
    measured.unit = "s"
    again = simulate_measured(schedule, measured)
    assert again.unit == "s"
    assert times(again) == times(simulate(schedule, **costs))


def test_summary_of_1f1b():
    schedule = one_f_one_b(2, 4)
    row = summary(schedule, simulate(schedule))
    assert row == {"schedule": "1F1B", "ranks": 2, "microbatches": 4, "makespan": 15.0,
                   "bubble_fraction": pytest.approx(3 / 15), "bubble": 3.0,
                   "activations": 2.0, "parameters": 1.0, "messages": 8}


def test_an_i_without_its_w_holds_the_microbatch_until_the_i():
    # F0 F1 I0 F2 I1 I2 on one rank: micro-batch 0 held from 0 to 3, 1 from 1 to 5, 2 from
    # 3 to 6; at 3 micro-batch 0 is released as 2 is taken: never more than 2.
    kinds = [("F", 0), ("F", 1), ("I", 0), ("F", 2), ("I", 1), ("I", 2)]
    events = [Event(0, Action(0, k, i), t, t + 1) for t, (k, i) in enumerate(kinds)]
    assert Timeline(1, events).peak_in_flight() == [2]
    # A forward whose backward is not in the timeline is held to its end.
    events = [Event(0, Action(0, "F", 0), 0, 1), Event(0, Action(0, "F", 1), 2, 3)]
    assert Timeline(1, events).peak_in_flight() == [2]


def test_weight_may_cost_the_whole_backward():
    t = simulate(zb_h1(2, 2), backward=2.0, weight=2.0)   # I costs nothing
    assert all(e.duration == 0.0 for e in t.events if e.action.kind == "I")


def test_simulated_events_come_by_start_then_rank_with_the_schedules_title():
    for name in ("1f1b", "zb_v", "dualpipe_v"):
        schedule = build(name, 3, 6)
        t = simulate(schedule, forward=1.0, backward=2.0)
        assert t.title == schedule.name and t.unit == ""
        keys = [(e.start, e.rank) for e in t.events]
        assert keys == sorted(keys) and len(set(keys)) == len(keys)


def test_rank_facts_per_rank_with_small_costs():
    schedule = one_f_one_b(2, 1)
    facts = rank_facts(schedule, simulate(schedule, forward=0.1, backward=0.2))
    assert [f.rank for f in facts] == [0, 1]
    assert [f.busy for f in facts] == pytest.approx([0.3, 0.3])
    assert [f.bubble for f in facts] == pytest.approx([0.3, 0.3])
    assert [f.gaps for f in facts] == pytest.approx([0.3, 0.0])  # rank 1 never waits


def test_simulate_measured_needs_a_forward_and_a_backward_on_every_stage():
    schedule = build("zb_h1", 2, 2)
    full = simulate(schedule)
    for drop, kind in (("F", "forward"), ("W", "backward")):
        events = [e for e in full.events if not (e.action.stage == 1 and e.action.kind == drop)]
        with pytest.raises(ValueError) as info:
            simulate_measured(schedule, Timeline(2, events))
        assert str(info.value) == ("the timeline has no forward or no backward on stage 1: "
                                   "it is not a run of ZB-H1 with 2 stages"), kind


def test_simulate_measured_uses_full_backwards_where_a_stage_has_no_w():
    # A stage that ran full backwards (B) and also recorded an I without its W is
    # simulated from its B.
    schedule = one_f_one_b(2, 2)
    t = simulate(schedule, forward=1.0, backward=[2.0, 4.0])
    extra = Event(1, Action(1, "I", 0), 100.0, 101.0)
    again = simulate_measured(schedule, Timeline(2, t.events + [extra]))
    assert times(again) == times(t)


def test_shifting_an_empty_timeline():
    assert Timeline(3).shifted().events == []
    t = Timeline(2, [Event(1, Action(1, "F", 0), 5.0, 6.0)], unit="s", title="run")
    assert t.shifted().events == [Event(1, Action(1, "F", 0), 0.0, 1.0)]
    assert t.shifted().title == "run"
