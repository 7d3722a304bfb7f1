"""Gantt charts and bubble curves draw what the timeline holds, nothing else."""
import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: E402
from matplotlib.colors import to_rgba  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from pipeline_lib import Action, Event, Timeline, bubble_theory, simulate  # noqa: E402
from pipeline_lib.viz.plot import (  # noqa: E402
    KIND_COLOURS,
    LABEL_POINTS,
    bubble_vs_microbatches,
    gantt,
    mark,
)
from pipeline_lib.schedules import gpipe, interleaved_1f1b, one_f_one_b, zb_h1  # noqa: E402


def axes(width: float = 12, height: float = 3):
    return Figure(figsize=(width, height)).subplots()


def action_collections(ax):
    """The boxes of actions (one collection per rank and model chunk), idle rows excluded."""
    return [c for c in ax.collections if c.get_zorder() == 1]


def boxes(ax):
    """(rank, start, duration, rgba) of every drawn action box, background rows excluded."""
    found = []
    for collection in action_collections(ax):
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


def test_a_measured_title_states_the_step_time_first():
    events = [Event(0, Action(0, "F", 0), 10.0, 10.004),
              Event(1, Action(1, "F", 0), 10.004, 10.0125)]
    ax = gantt(Timeline(2, events, unit="s"), ax=axes(), title="GPipe, measured")
    assert ax.get_title(loc="left") == "GPipe, measured: step 12.5 ms, bubble 50%"
    long = [Event(0, Action(0, "F", 0), 0.0, 2.5)]
    assert gantt(Timeline(1, long, unit="s"), ax=axes()).get_title(loc="left") == \
        "step 2.5 s, bubble 0%"


def test_boxes_carry_microbatch_numbers_and_interleaved_ones_their_stage():
    timeline = simulate(one_f_one_b(2, 3))
    texts = sorted(t.get_text() for t in gantt(timeline, ax=axes()).texts)
    assert texts == sorted(str(e.action.microbatch) for e in timeline.events)

    timeline = simulate(interleaved_1f1b(2, 2, 2))
    texts = [t.get_text() for t in gantt(timeline, ax=axes(width=30)).texts]
    assert sorted(t for t in texts if t.startswith("s")) == \
        sorted(f"s{e.action.stage}" for e in timeline.events)


def test_every_label_is_at_least_8_points():
    for timeline in (simulate(one_f_one_b(2, 3)), simulate(interleaved_1f1b(2, 4, 2))):
        ax = gantt(timeline, ax=axes(width=30))
        assert ax.texts and all(t.get_fontsize() >= LABEL_POINTS >= 8 for t in ax.texts)


def test_stages_are_left_out_where_two_lines_do_not_fit():
    timeline = simulate(interleaved_1f1b(4, 4, 2))
    flat = [t.get_text() for t in gantt(timeline, ax=axes(width=30, height=1.2)).texts]
    assert flat and not any(t.startswith("s") for t in flat)


def test_later_virtual_stages_are_hatched_the_first_not():
    ax = gantt(simulate(interleaved_1f1b(2, 4, 2)), ax=axes(width=30))
    hatches = [c.get_hatch() for c in action_collections(ax)]
    assert hatches == [None, "///"] * 2          # per rank: virtual stage 1, virtual stage 2
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert "second virtual stage on a rank" in legend
    assert gantt(simulate(gpipe(2, 2)), ax=axes()).collections[1].get_hatch() is None


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


def test_marks_sit_on_row_edges_off_the_labels_and_join_the_legend():
    timeline = simulate(one_f_one_b(2, 4), forward=0.01, backward=0.02)
    timeline.unit = "s"
    ax = gantt(timeline, ax=axes())
    times = [(e.start + e.end) / 2 for e in timeline.events if e.action.kind == "B"]
    rows = [e.rank for e in timeline.events if e.action.kind == "B"]
    mark(ax, timeline, times, rows, "all-reduce")
    (line,) = ax.lines
    assert list(line.get_xdata()) == pytest.approx([t * 1e3 for t in times])   # ms from 0
    assert list(line.get_ydata()) == pytest.approx([r - 0.4 for r in rows])
    canvas = FigureCanvasAgg(ax.figure)     # right above each box's label
    canvas.draw()
    renderer = canvas.get_renderer()
    half = line.get_markersize() / 2 * ax.figure.dpi / 72
    labels = [t.get_window_extent(renderer) for t in ax.texts]
    for x, y in ax.transData.transform(list(zip(line.get_xdata(), line.get_ydata()))):
        assert not any(b.x0 < x + half and x - half < b.x1 and b.y0 < y + half and
                       y - half < b.y1 for b in labels), "a marker covers a label"
    assert [t.get_text() for t in ax.get_legend().get_texts()][-1] == "all-reduce"


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
    ax = bubble_vs_microbatches([2, 4], [1, 2, 3, 4, 6, 8], [1, 2],
                                measured={(2, 1): {1: 0.45, 4: 0.2}}, ax=axes(7, 4))
    drawn = ax.lines          # per (p, v): the theory line, its simulated dots, measured
    ms = [1, 2, 3, 4, 6, 8]
    k = 0
    for p, v in [(2, 1), (2, 2), (4, 1), (4, 2)]:
        theory, dots = drawn[k], drawn[k + 1]
        assert theory.get_label() == f"p={p}" + (f", v={v}" if v > 1 else "")
        assert list(theory.get_ydata()) == pytest.approx(
            [bubble_theory(p, m, v) for m in theory.get_xdata()])
        # interleaved: the formula's line from m = p, where it holds
        start = 1 if v == 1 else p
        assert (theory.get_xdata()[0], theory.get_xdata()[-1]) == (start, 8)
        # the simulator at every m, interleaved too (it takes any m >= 1)
        # one style per series: circles for 1F1B, squares for interleaved
        assert dots.get_marker() == ("o" if v == 1 else "s") and list(dots.get_xdata()) == ms
        for m, y in zip(ms, dots.get_ydata()):
            if m >= start:
                assert y == pytest.approx(bubble_theory(p, m, v)), (p, v, m)
            else:    # one round of m < p: the loop waits for each micro-batch to come round
                assert y == pytest.approx((v * (p - m) + m - 1) / (v * p + m - 1)), (p, v, m)
                assert y > bubble_theory(p, m, v)
        k += 2
        if (p, v) == (2, 1):
            crosses = drawn[k]
            assert crosses.get_marker() == "x"
            assert list(zip(crosses.get_xdata(), crosses.get_ydata())) == [(1, 0.45), (4, 0.2)]
            k += 1
    assert k == len(drawn)
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert {"simulated, v = 1", "simulated, v > 1", "measured, v = 1",
            "measured, v > 1"} <= set(legend)


def test_measured_interleaved_points_are_plus_signs_not_crosses():
    ax = bubble_vs_microbatches([2], [2, 4], [1, 2], measured={(2, 2): {2: 0.3}},
                                ax=axes(7, 4))
    assert [line.get_marker() for line in ax.lines if line.get_linestyle() == "None"] == \
        ["o", "s", "+"]


def test_rows_holding_several_stages_name_them():
    ax = gantt(simulate(interleaved_1f1b(2, 4, 2)), ax=axes())
    assert [t.get_text() for t in ax.get_yticklabels()] == ["rank 0: s0, s2", "rank 1: s1, s3"]
    assert [t.get_text() for t in gantt(simulate(gpipe(2, 2)), ax=axes()).get_yticklabels()] \
        == ["rank 0", "rank 1"]


def test_a_window_draws_part_of_the_step_with_room_for_the_stage_labels():
    timeline = simulate(interleaved_1f1b(4, 8, 2), forward=0.5, backward=1.0)
    whole = gantt(timeline, ax=axes(width=10, height=3))
    part = gantt(timeline, ax=axes(width=10, height=3), window=(0, 6))
    assert part.get_xlim() == (0, 6)
    def stage_labels(ax):
        return [t for t in ax.texts if t.get_text().startswith("s") and t.get_position()[0] <= 6]
    assert len(stage_labels(part)) > len(stage_labels(whole))   # the forwards' too
    assert all(0 <= t.get_position()[0] <= 6 for t in part.texts)


def test_a_window_draws_only_the_boxes_in_view():
    timeline = simulate(interleaved_1f1b(4, 8, 2), forward=0.5, backward=1.0)

    def boxes(ax) -> int:      # the action boxes: every bar but each row's idle one
        return sum(len(bars.get_paths()) for bars in ax.collections) - timeline.ranks

    whole = boxes(gantt(timeline, ax=axes()))
    part = boxes(gantt(timeline, ax=axes(), window=(0, 6)))
    in_view = [e for e in timeline.events if e.start <= 6]
    assert whole == len(timeline.events)
    assert 0 < part == len(in_view) < whole


def test_legend_handles_cover_several_charts():
    from pipeline_lib.viz.plot import legend_handles
    labels = [h.get_label() for h in legend_handles([simulate(gpipe(2, 2)),
                                                     simulate(zb_h1(2, 2), weight=1.0),
                                                     simulate(interleaved_1f1b(2, 2, 2))])]
    assert labels == ["F forward", "B backward", "I input grad", "W weight grad",
                      "first virtual stage on a rank", "second virtual stage on a rank",
                      "idle"]
