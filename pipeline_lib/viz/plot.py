"""Gantt charts of pipeline timelines, simulated or measured, and bubble-vs-m curves.

One drawing function for both kinds of `Timeline` is the point: a measured step and the
simulator's prediction look alike, so they can be compared by eye as well as by number.
"""
from __future__ import annotations

from collections import Counter
from typing import Mapping, Sequence

import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.colors import to_rgb
from matplotlib.legend import Legend
from matplotlib.legend_handler import HandlerBase
from matplotlib.lines import Line2D
from matplotlib.patches import Patch, Rectangle
from matplotlib.ticker import PercentFormatter

from pipeline_lib.schedules import build
from pipeline_lib.timeline import Timeline, bubble_theory, simulate

# Colour-blind-safe (Okabe-Ito): a backward is warm, a forward cool; I and W are the
# two halves of B, so they get B's neighbours.
KIND_COLOURS = {"F": "#0072B2", "B": "#E69F00", "I": "#D55E00", "W": "#009E73"}
KIND_NAMES = {"F": "forward", "B": "backward", "I": "input grad", "W": "weight grad"}
IDLE_COLOUR = "#ECECEC"
# A rank's later virtual stages (interleaved and V schedules): paler and hatched, so they are told
# apart in print and by readers who do not tell the shades apart.
VIRTUAL_STAGE_HATCHES = ("", "///", "xxx", "...")
HATCH_COLOUR = (0.0, 0.0, 0.0, 0.35)
LABEL_POINTS = 8          # every label in a box; smaller would not be read


def _lighter(colour: str, amount: float) -> tuple[float, float, float]:
    """Mix ``colour`` with white: a rank's later virtual stages look paler."""
    return tuple(c + (1.0 - c) * amount for c in to_rgb(colour))


def _time_scale(timeline: Timeline) -> tuple[float, str]:
    """Measured steps are milliseconds long: label them in ms rather than 0.00x s."""
    if timeline.unit == "s" and timeline.makespan < 1.0:
        return 1e3, "time (ms)"
    if timeline.unit:
        return 1.0, f"time ({timeline.unit})"
    return 1.0, "time (simulated cost units)"


def _step_time(timeline: Timeline) -> str:
    """A measured step's length, first action's start to last action's end: '130 ms'."""
    scale, label = _time_scale(timeline)
    unit = label[len("time ("):-1]
    return f"{timeline.makespan * scale:.3g} {unit}"


def _virtual_stage_of(timeline: Timeline) -> dict[tuple[int, int], int]:
    """(row, stage) -> which of its row's virtual stages the stage is, counted from the
    row's first stage. Read from the events rather than computed as ``stage // rows``,
    which holds only when every row is one pipeline rank: a gathered run with replicas
    has ``dp × pp`` rows, and a V-shaped schedule's second virtual stage runs backwards."""
    stages: dict[int, set[int]] = {}
    for e in timeline.events:
        stages.setdefault(e.rank, set()).add(e.action.stage)
    return {(row, stage): k for row, held in stages.items()
            for k, stage in enumerate(sorted(held))}


def _axes_points(ax: Axes) -> tuple[float, float]:
    """The axes' width and height in points (1/72 inch), where a label must fit."""
    box = ax.get_position()
    return (box.width * ax.figure.get_figwidth() * 72,
            box.height * ax.figure.get_figheight() * 72)


def _legend(ax: Axes, handles: list) -> None:
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False,
              fontsize=8)


def gantt(timeline: Timeline, ax: Axes | None = None, title: str | None = None,
          labels: bool = True, legend: bool = True,
          window: tuple[float, float] | None = None) -> Axes:
    """Draw one row per rank, one box per action, on a grey row that shows idle time.

    Boxes are coloured by kind (F, B, I, W) and carry the micro-batch number; when a
    rank holds several stages (interleaved and V schedules) its later virtual stages are
    paler and hatched, its row is labelled with the stages it holds, and the stage is
    written under the number where the box is tall and wide enough. Labels are 8 pt; a
    label that would not fit its box is left out rather than overprinted. ``window``
    (start, end, in the axis' units) draws that stretch of the step only, at the axes'
    full width: half-stage boxes too narrow for their labels in the whole step get room
    there. The title ends with the bubble fraction, and for a measured timeline (one with
    a unit) the step's length first, so a chart states the numbers it shows.
    """
    if not isinstance(timeline, Timeline):
        raise TypeError(f"gantt draws a Timeline (from simulate() or pipe.timeline), "
                        f"got {type(timeline).__name__}")
    if timeline.makespan == 0:
        raise ValueError("the timeline has no events that took any time: simulate a "
                         "schedule or run pipe.step(...) before drawing pipe.timeline")
    timeline = timeline.shifted()
    if ax is None:
        _, ax = plt.subplots(figsize=(10, 0.45 * timeline.ranks + 1.3))
    scale, xlabel = _time_scale(timeline)
    span = timeline.makespan * scale
    shown = (0.0, span) if window is None else window
    virtual = _virtual_stage_of(timeline)
    per_rank = max(virtual.values()) + 1
    interleaved = per_rank > 1

    def paler(k: int) -> float:
        return 0.5 * k / (per_rank - 1) if interleaved else 0.0

    # Only the boxes in the window: a planned step of a large run has thousands, and each
    # drawn off-screen still costs its hatching when the figure is rendered.
    in_view: dict[tuple[int, int], list] = {}
    for e in timeline.events:
        if e.end * scale >= shown[0] and e.start * scale <= shown[1]:
            in_view.setdefault((e.rank, virtual[e.rank, e.action.stage]), []).append(e)
    for rank in range(timeline.ranks):
        ax.broken_barh([(0, span)], (rank - 0.4, 0.8), color=IDLE_COLOUR, zorder=0)
        for k in range(per_rank):
            events = in_view.get((rank, k))
            if not events:
                continue
            boxes = ax.broken_barh(
                [(e.start * scale, e.duration * scale) for e in events], (rank - 0.4, 0.8),
                facecolors=[_lighter(KIND_COLOURS[e.action.kind], paler(k)) for e in events],
                edgecolor="white", linewidth=0.6, zorder=1,
                hatch=VIRTUAL_STAGE_HATCHES[k % len(VIRTUAL_STAGE_HATCHES)] or None)
            boxes.set_hatchcolor(HATCH_COLOUR)

    if labels:
        width, height = _axes_points(ax)
        two_lines = 0.8 * height / timeline.ranks >= 2.5 * LABEL_POINTS
        for e in timeline.events:
            if not shown[0] <= e.start * scale <= e.end * scale <= shown[1]:
                continue                                  # labels for whole boxes only
            box_points = e.duration * scale / (shown[1] - shown[0]) * width
            k = virtual[e.rank, e.action.stage]
            colour = "white" if k == 0 else "black"
            centre = (e.start + e.duration / 2) * scale
            lines = [str(e.action.microbatch)]
            if interleaved and two_lines:
                lines.append(f"s{e.action.stage}")
            for j, text in enumerate(lines):
                if box_points < 0.65 * LABEL_POINTS * len(text) + 2:
                    continue
                offset = (j - (len(lines) - 1) / 2) * 0.36
                ax.text(centre, e.rank + offset, text, ha="center", va="center",
                        fontsize=LABEL_POINTS, color=colour, zorder=2)

    ax.set_ylim(timeline.ranks - 0.5, -0.5)       # rank 0 on top, as in the papers
    ax.set_yticks(range(timeline.ranks), [_row_label(r, virtual) if interleaved
                                          else f"rank {r}" for r in range(timeline.ranks)])
    ax.set_xlim(*shown)
    ax.set_xlabel(xlabel)
    ax.tick_params(axis="y", length=0)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    name = timeline.title if title is None else title
    numbers = f"bubble {timeline.bubble_fraction():.0%}"
    if timeline.unit:
        numbers = f"step {_step_time(timeline)}, {numbers}"
    ax.set_title(f"{name}: {numbers}" if name else numbers, loc="left", fontsize=10)
    if legend:
        _legend(ax, legend_handles([timeline]))
    return ax


def _row_label(row: int, virtual: dict[tuple[int, int], int]) -> str:
    """'rank 0: s0, s7': a row that holds several stages names them, first virtual stage
    first, so every box can be read as a stage even where it is too small for a label."""
    held = sorted((k, stage) for (r, stage), k in virtual.items() if r == row)
    return f"rank {row}: " + ", ".join(f"s{stage}" for _, stage in held)


ORDINALS = ("first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth")


class VirtualStageSwatch(Patch):
    """A legend entry for one virtual stage of a rank: a strip of the action kinds'
    colours, each as that virtual stage's boxes show it (paler and hatched after the
    first). Drawn by `_VirtualStageHandler`, registered with matplotlib for every legend,
    so ``ax.legend(handles=...)`` and ``fig.legend(handles=...)`` draw it alike."""

    def __init__(self, colours: Sequence[tuple[float, float, float]], hatch: str, label: str):
        super().__init__(label=label, hatch=hatch or None)
        self.colours = list(colours)


class _VirtualStageHandler(HandlerBase):
    def create_artists(self, legend, orig_handle, xdescent, ydescent,  # type: ignore
                       width, height, fontsize, trans):
        step = width / len(orig_handle.colours)
        strip = []
        for j, colour in enumerate(orig_handle.colours):
            box = Rectangle((-xdescent + j * step, -ydescent), step, height, facecolor=colour,
                            edgecolor="none", hatch=orig_handle.get_hatch(), transform=trans)
            box.set_hatchcolor(HATCH_COLOUR)
            strip.append(box)
        return strip


Legend.update_default_handler_map({VirtualStageSwatch: _VirtualStageHandler()})


def legend_handles(timelines: Sequence[Timeline]) -> list[Patch]:
    """The legend of `gantt` for charts of ``timelines``: the action kinds they hold, the
    virtual stages of their ranks (each a strip of those kinds' colours as its boxes show
    them: "first virtual stage on a rank", "second ..."), idle. One legend for a figure of
    several charts keeps every chart's time axis the same width (``gantt(...,
    legend=False)`` on each)."""
    events = [e for t in timelines for e in t.events]
    kinds = [k for k in KIND_COLOURS if any(e.action.kind == k for e in events)]
    per_rank = max(max(_virtual_stage_of(t).values()) + 1 for t in timelines)
    handles: list[Patch] = [Patch(color=KIND_COLOURS[k], label=f"{k} {KIND_NAMES[k]}")
                            for k in kinds]
    if per_rank > 1:
        handles += [VirtualStageSwatch(
            [_lighter(KIND_COLOURS[kind], 0.5 * k / (per_rank - 1)) for kind in kinds],
            VIRTUAL_STAGE_HATCHES[k % len(VIRTUAL_STAGE_HATCHES)],
            f"{ORDINALS[k] if k < len(ORDINALS) else f'{k + 1}th'} virtual stage on a rank")
            for k in range(per_rank)]
    handles.append(Patch(color=IDLE_COLOUR, label="idle"))
    return handles


#: where `mark` puts a marker on a row: the top edge of its boxes, or the bottom one
_EDGE = {"top": -0.4, "bottom": 0.4}


def mark(ax: Axes, timeline: Timeline, times: Sequence[float], rows: Sequence[int],
         label: str, marker: str = "v", colour: str = "black", edge: str = "top") -> None:
    """Mark moments on a `gantt` of ``timeline`` (an all-reduce, say): ``times`` in the
    timeline's own clock, one row each. A marker sits on the top edge of its row's boxes,
    pointing down (or on the bottom ``edge``: pass ``marker="^"``), so it never covers the
    numbers written in them; the legend gains it."""
    scale, _ = _time_scale(timeline)
    t0 = min(e.start for e in timeline.events)
    (line,) = ax.plot([(t - t0) * scale for t in times], [r + _EDGE[edge] for r in rows], marker,
                      color=colour, markersize=7, linestyle="", clip_on=False, zorder=3,
                      label=label)
    legend = ax.get_legend()
    if legend is not None:
        _legend(ax, [*legend.legend_handles, line])


def gantt_with_messages(timeline: Timeline, rows: Sequence[Sequence[str]],
                        ax: Axes | None = None, title: str | None = None) -> Axes:
    """`gantt` of a schedule's ``timeline``, with the messages of a lowered program of that
    schedule (``rows``: one list of PyTorch's action strings per rank, as
    `Schedule.to_csv`'s ``compute_comms`` file or `pytorch.private.runtime_lowering`
    gives): a downward triangle on a row's top edge where the rank posts a receive, an
    upward one on its bottom edge where it sends, each at the moment the rank reaches it
    in its program (the end of the compute action before it). Messages at the same moment
    share a triangle, with their number beside it."""
    from pipeline_lib.pytorch.notation import Message, compute_actions, parse
    ax = gantt(timeline, ax=ax, title=title)
    end = {e.action: e.end for e in timeline.events}
    moments: dict[str, tuple[list[float], list[int]]] = {"RECV": ([], []), "SEND": ([], [])}
    for rank, row in enumerate(rows):
        clock = min(e.start for e in timeline.events)
        for cell in row:
            token = parse(cell)
            if compute_actions(token):
                clock = max(end[a] for a in compute_actions(token))
            elif isinstance(token, Message):
                times, ranks = moments[token.kind[:4]]
                times.append(clock)
                ranks.append(rank)
    mark(ax, timeline, *moments["RECV"], "receive posted")
    mark(ax, timeline, *moments["SEND"], "send", marker="^", edge="bottom")
    scale, _ = _time_scale(timeline)
    t0 = min(e.start for e in timeline.events)
    for kind, edge in (("RECV", "top"), ("SEND", "bottom")):
        for (time, rank), count in Counter(zip(*moments[kind])).items():
            if count > 1:
                ax.text((time - t0) * scale, rank + _EDGE[edge], f" {count}", ha="left",
                        va="center", fontsize=LABEL_POINTS, zorder=4, clip_on=False)
    return ax


def bubble_vs_microbatches(ranks: Sequence[int], microbatches: Sequence[int],
                           virtual_stages: Sequence[int] = (1,),
                           measured: Mapping[tuple[int, int], Mapping[int, float]] | None = None,
                           ax: Axes | None = None) -> Axes:
    """Bubble fraction against micro-batches m: theory as lines, the simulator as open
    markers, and measured runs (``measured[(p, v)][m]``) as crosses, one colour per p.

    v = 1 is 1F1B (GPipe's bubble is the same): solid lines, circles, crosses. v > 1 is
    interleaved 1F1B: dashed lines, squares, plus signs, simulated at every m; its theory
    line starts at m = p: below, one round of m < p micro-batches cannot keep the loop
    busy, and its squares sit above the formula, where no line reaches them. Each series
    has its own style, so no interleaved point reads as a 1F1B one. Forward costs 1,
    backward 2, split evenly over a rank's v virtual stages, so every curve describes the
    same model.
    """
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 4))
    measured = measured or {}
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    styles = ["-", "--", ":", "-."]
    for k, p in enumerate(ranks):
        for j, v in enumerate(virtual_stages):
            ms = sorted(microbatches)
            colour, style = colours[k % len(colours)], styles[j % len(styles)]
            low = min(ms) if v == 1 else max(min(ms), p)      # the formula holds from there
            dense = ([low + (max(ms) - low) * t / 200 for t in range(201)]
                     if low <= max(ms) else [])
            ax.plot(dense, [bubble_theory(p, m, v) for m in dense], style, color=colour,
                    label=f"p={p}" + (f", v={v}" if v > 1 else ""))
            name = "1f1b" if v == 1 else "interleaved_1f1b"
            simulated = [simulate(build(name, p, m, v), forward=1 / v,
                                  backward=2 / v).bubble_fraction() for m in ms]
            ax.plot(ms, simulated, "o" if v == 1 else "s", color=colour,
                    markerfacecolor="none", markersize=6 if v == 1 else 7)
            points = sorted(measured.get((p, v), {}).items())
            if points:
                ax.plot(*zip(*points), "x" if v == 1 else "+", color=colour,
                        markersize=8 if v == 1 else 10, markeredgewidth=2)
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted(set(microbatches)), [str(m) for m in sorted(set(microbatches))])
    ax.minorticks_off()
    ax.yaxis.set_major_formatter(PercentFormatter(1.0))
    ax.set_ylim(0, None)
    ax.set_xlabel("micro-batches m")
    ax.set_ylabel("bubble (share of total time)")
    ax.set_title("Bubble (p−1)/(v·m+p−1)", loc="left", fontsize=10)
    looped = any(v > 1 for v in virtual_stages)
    markers = [Line2D([], [], color="grey", label="theory"),
               Line2D([], [], color="grey", marker="o", markerfacecolor="none",
                      linestyle="", label="simulated" + (", v = 1" if looped else ""))]
    if looped:
        markers.append(Line2D([], [], color="grey", marker="s", markerfacecolor="none",
                              linestyle="", label="simulated, v > 1"))
    if measured:
        markers.append(Line2D([], [], color="grey", marker="x", markeredgewidth=2,
                              linestyle="", label="measured" + (", v = 1" if looped else "")))
        if looped:
            markers.append(Line2D([], [], color="grey", marker="+", markeredgewidth=2,
                                  markersize=10, linestyle="", label="measured, v > 1"))
    handles, _ = ax.get_legend_handles_labels()
    _legend(ax, handles + markers)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    return ax
