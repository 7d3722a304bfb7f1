"""Gantt charts and bubble curves draw what the timeline holds, nothing else."""
import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
from matplotlib.colors import to_rgba  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from pipeline_lib import Action, Event, Timeline, bubble_theory, simulate  # noqa: E402
from pipeline_lib.viz.plot import KIND_COLOURS, bubble_vs_microbatches, gantt  # noqa: E402
from pipeline_lib.schedules import gpipe, interleaved_1f1b, one_f_one_b, zb_h1  # noqa: E402


def axes(width: float = 12, height: float = 3):
    return Figure(figsize=(width, height)).subplots()


def boxes(ax):
    """(rank, start, duration, rgba) of every drawn action box, background rows excluded."""
    found = []
    for collection in ax.collections[1::2]:     # each rank: idle row, then its actions
        for path, colour in zip(collection.get_paths(), collection.get_facecolors()):
            box = path.get_extents()
            found.append((round(box.y0 + 0.4), round(box.x0, 9), round(box.width, 9),
                          *(round(c, 9) for c in colour)))
    return sorted(found)


def test_every_event_is_a_box_of_its_kind_colour_on_its_rank():
    timeline = simulate(zb_h1(3, 4), weight=1.0)
    ax = gantt(timeline, ax=axes())
    expected = sorted((e.rank, round(e.start, 9), round(e.duration, 9),
                       *(round(c, 9) for c in to_rgba(KIND_COLOURS[e.action.kind])))
                      for e in timeline.events)
    assert boxes(ax) == expected


def test_idle_rows_span_the_whole_step():
    timeline = simulate(gpipe(3, 2))
    ax = gantt(timeline, ax=axes())
    rows = [c.get_paths()[0].get_extents() for c in ax.collections[0::2]]
    assert len(rows) == 3
    assert all(r.x0 == 0 and r.width == pytest.approx(timeline.makespan) for r in rows)


def test_title_states_the_bubble_fraction():
    timeline = simulate(gpipe(4, 2))
    ax = gantt(timeline, ax=axes(), title="mine")
    assert ax.get_title(loc="left") == f"mine: bubble {timeline.bubble_fraction():.0%}"
    assert gantt(timeline, ax=axes()).get_title(loc="left").startswith("GPipe: bubble")


def test_boxes_carry_microbatch_numbers_and_interleaved_ones_their_stage():
    timeline = simulate(one_f_one_b(2, 3))
    texts = sorted(t.get_text() for t in gantt(timeline, ax=axes()).texts)
    assert texts == sorted(str(e.action.microbatch) for e in timeline.events)

    timeline = simulate(interleaved_1f1b(2, 2, 2))
    texts = [t.get_text() for t in gantt(timeline, ax=axes(width=30)).texts]
    assert sorted(t for t in texts if t.startswith("s")) == \
        sorted(f"s{e.action.stage}" for e in timeline.events)


def test_later_chunks_are_paler_also_with_replicas():
    """A gathered run with dp = 2 replicas has 2 x pp rows; each row's second chunk is
    paler than its first (it was shaded as the first when chunks were stage // rows)."""
    one = simulate(interleaved_1f1b(2, 4, 2))
    replica = [Event(e.rank + 2, e.action, e.start, e.end) for e in one.events]
    both = Timeline(4, one.events + replica)
    found = boxes(gantt(both, ax=axes(width=30)))
    shade = {}
    for e in both.events:
        row = [b for b in found if b[0] == e.rank and b[1] == round(e.start, 9)]
        shade[e.rank, e.action.stage] = row[0][3:6]
    for row in range(4):
        first, second = sorted(s for r, s in shade if r == row)
        assert shade[row, first] != shade[row, second]
        assert sum(shade[row, second]) > sum(shade[row, first])   # paler is lighter


def test_labels_that_do_not_fit_are_left_out():
    timeline = simulate(one_f_one_b(4, 64))
    ax = gantt(timeline, ax=axes(width=3))
    assert len(ax.texts) < len(timeline.events)


def test_legend_lists_the_kinds_present_and_idle():
    ax = gantt(simulate(zb_h1(2, 2)), ax=axes())
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels == ["F forward", "I input grad", "W weight grad", "idle"]


def test_measured_timelines_start_at_zero_in_milliseconds():
    events = [Event(0, Action(0, "F", 0), 100.002, 100.004),
              Event(1, Action(1, "F", 0), 100.005, 100.007)]
    ax = gantt(Timeline(2, events, unit="s"), ax=axes())
    assert ax.get_xlabel() == "time (ms)"
    assert ax.get_xlim() == pytest.approx((0, 5))
    assert [b[1] for b in boxes(ax)] == pytest.approx([0, 3])


def test_without_axes_it_makes_a_figure():
    ax = gantt(simulate(gpipe(2, 2)))
    assert ax.figure is not None
    plt.close(ax.figure)


def test_bad_input_is_explained():
    with pytest.raises(TypeError, match="Timeline"):
        gantt(gpipe(2, 2), ax=axes())
    with pytest.raises(ValueError, match="no events"):
        gantt(Timeline(2, []), ax=axes())
    with pytest.raises(ValueError, match="no events"):
        gantt(simulate(gpipe(2, 2), forward=0, backward=0), ax=axes())


def test_bubble_curves_follow_theory_simulation_and_measurements():
    ax = bubble_vs_microbatches([2, 4], [1, 2, 4, 8], [1, 2],
                                measured={(2, 1): {1: 0.45, 4: 0.2}}, ax=axes(7, 4))
    drawn = ax.lines          # per (p, v): the theory line, its simulated dots, measured
    curves = {(2, 1): [1, 2, 4, 8], (2, 2): [2, 4, 8], (4, 1): [1, 2, 4, 8], (4, 2): [4, 8]}
    k = 0
    for (p, v), ms in curves.items():
        theory, dots = drawn[k], drawn[k + 1]
        assert theory.get_label() == f"p={p}" + (f", v={v}" if v > 1 else "")
        assert list(theory.get_ydata()) == pytest.approx(
            [bubble_theory(p, m, v) for m in theory.get_xdata()])
        assert (theory.get_xdata()[0], theory.get_xdata()[-1]) == (ms[0], ms[-1])
        assert dots.get_marker() == "o" and list(dots.get_xdata()) == ms
        assert list(dots.get_ydata()) == pytest.approx([bubble_theory(p, m, v) for m in ms])
        k += 2
        if (p, v) == (2, 1):
            crosses = drawn[k]
            assert crosses.get_marker() == "x"
            assert list(zip(crosses.get_xdata(), crosses.get_ydata())) == [(1, 0.45), (4, 0.2)]
            k += 1
    assert k == len(drawn)
