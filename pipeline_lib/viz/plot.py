"""Gantt charts of pipeline timelines, simulated or measured, and bubble-vs-m curves.

One drawing function for both kinds of `Timeline` is the point: a measured step and the
simulator's prediction look alike, so they can be compared by eye as well as by number.
"""
from __future__ import annotations

from typing import Mapping, Sequence

import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.colors import to_rgb
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.ticker import PercentFormatter

from pipeline_lib.schedules import build
from pipeline_lib.timeline import Timeline, bubble_theory, simulate

# Colour-blind-safe (Okabe-Ito): a backward is warm, a forward cool; I and W are the
# two halves of B, so they get B's neighbours.
KIND_COLOURS = {"F": "#0072B2", "B": "#E69F00", "I": "#D55E00", "W": "#009E73"}
KIND_NAMES = {"F": "forward", "B": "backward", "I": "input grad", "W": "weight grad"}
IDLE_COLOUR = "#ECECEC"


def _lighter(colour: str, amount: float) -> tuple[float, float, float]:
    """Mix ``colour`` with white: later model chunks of an interleaved rank look paler."""
    return tuple(c + (1.0 - c) * amount for c in to_rgb(colour))


def _time_scale(timeline: Timeline) -> tuple[float, str]:
    """Measured steps are milliseconds long: label them in ms rather than 0.00x s."""
    if timeline.unit == "s" and timeline.makespan < 1.0:
        return 1e3, "time (ms)"
    if timeline.unit:
        return 1.0, f"time ({timeline.unit})"
    return 1.0, "time (simulated cost units)"


def _chunk_of(timeline: Timeline) -> dict[tuple[int, int], int]:
    """(row, stage) -> which of its row's model chunks the stage is, counted from the
    row's first stage. Read from the events rather than computed as ``stage // rows``,
    which holds only when every row is one pipeline rank: a gathered run with replicas
    has ``dp × pp`` rows, and a V-shaped schedule's second chunk runs backwards."""
    stages: dict[int, set[int]] = {}
    for e in timeline.events:
        stages.setdefault(e.rank, set()).add(e.action.stage)
    return {(row, stage): k for row, held in stages.items()
            for k, stage in enumerate(sorted(held))}


def gantt(timeline: Timeline, ax: Axes | None = None, title: str | None = None,
          labels: bool = True, legend: bool = True) -> Axes:
    """Draw one row per rank, one box per action, on a grey row that shows idle time.

    Boxes are coloured by kind (F, B, I, W) and carry the micro-batch number; when a
    rank holds several stages (interleaved schedules) the stage is written small under
    it and later model chunks are paler. The title ends with the bubble fraction, so a
    chart always states the number it illustrates. Labels that would not fit their box
    are left out rather than overprinted.
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
    chunk = _chunk_of(timeline)
    chunks = max(chunk.values()) + 1
    interleaved = chunks > 1

    for rank in range(timeline.ranks):
        ax.broken_barh([(0, span)], (rank - 0.4, 0.8), color=IDLE_COLOUR, zorder=0)
        events = [e for e in timeline.events if e.rank == rank]
        colours = [_lighter(KIND_COLOURS[e.action.kind],
                            0.45 * chunk[e.rank, e.action.stage] / chunks) for e in events]
        ax.broken_barh([(e.start * scale, e.duration * scale) for e in events],
                       (rank - 0.4, 0.8), facecolors=colours, edgecolor="white",
                       linewidth=0.6, zorder=1)

    if labels:
        axes_points = ax.get_position().width * ax.figure.get_figwidth() * 72
        for e in timeline.events:
            box_points = e.duration * scale / span * axes_points
            text = str(e.action.microbatch)
            if box_points < 6.5 * len(text) + 2:
                continue
            centre = (e.start + e.duration / 2) * scale
            ax.text(centre, e.rank - (0.12 if interleaved else 0), text, ha="center",
                    va="center", fontsize=8, color="white", zorder=2)
            if interleaved:
                ax.text(centre, e.rank + 0.25, f"s{e.action.stage}", ha="center",
                        va="center", fontsize=5.5, color="white", zorder=2)

    ax.set_ylim(timeline.ranks - 0.5, -0.5)       # rank 0 on top, as in the papers
    ax.set_yticks(range(timeline.ranks), [f"rank {r}" for r in range(timeline.ranks)])
    ax.set_xlim(0, span)
    ax.set_xlabel(xlabel)
    ax.tick_params(axis="y", length=0)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    name = timeline.title if title is None else title
    bubble = f"bubble {timeline.bubble_fraction():.0%}"
    ax.set_title(f"{name}: {bubble}" if name else bubble, loc="left", fontsize=10)
    if legend:
        kinds = [k for k in KIND_COLOURS if any(e.action.kind == k for e in timeline.events)]
        handles = [Patch(color=KIND_COLOURS[k], label=f"{k} {KIND_NAMES[k]}") for k in kinds]
        if interleaved:
            handles.append(Patch(color=_lighter("#555555", 0.45), label="paler: later chunk"))
        handles.append(Patch(color=IDLE_COLOUR, label="idle"))
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0),
                  frameon=False, fontsize=8)
    return ax


def bubble_vs_microbatches(ranks: Sequence[int], microbatches: Sequence[int],
                           virtual_stages: Sequence[int] = (1,),
                           measured: Mapping[tuple[int, int], Mapping[int, float]] | None = None,
                           ax: Axes | None = None) -> Axes:
    """Bubble fraction against micro-batches m: theory as lines, the simulator as dots,
    and measured runs (``measured[(p, v)][m]``) as crosses, one colour per p.

    v = 1 is 1F1B (GPipe's bubble is the same); v > 1 is interleaved 1F1B, drawn dashed
    and only at the m it accepts (multiples of p). Forward costs 1, backward 2, split
    evenly over a rank's v chunks, so every curve describes the same model.
    """
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 4))
    measured = measured or {}
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    styles = ["-", "--", ":", "-."]
    for k, p in enumerate(ranks):
        for j, v in enumerate(virtual_stages):
            ms = [m for m in microbatches if v == 1 or m % p == 0]
            if not ms:
                continue
            colour, style = colours[k % len(colours)], styles[j % len(styles)]
            dense = [min(ms) + (max(ms) - min(ms)) * t / 200 for t in range(201)]
            ax.plot(dense, [bubble_theory(p, m, v) for m in dense], style, color=colour,
                    label=f"p={p}" + (f", v={v}" if v > 1 else ""))
            name = "1f1b" if v == 1 else "interleaved_1f1b"
            simulated = [simulate(build(name, p, m, v), forward=1 / v,
                                  backward=2 / v).bubble_fraction() for m in ms]
            ax.plot(ms, simulated, "o", color=colour, markerfacecolor="none")
            points = sorted(measured.get((p, v), {}).items())
            if points:
                ax.plot(*zip(*points), "x", color=colour, markersize=8, markeredgewidth=2)
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted(set(microbatches)), [str(m) for m in sorted(set(microbatches))])
    ax.minorticks_off()
    ax.yaxis.set_major_formatter(PercentFormatter(1.0))
    ax.set_ylim(0, None)
    ax.set_xlabel("micro-batches m")
    ax.set_ylabel("bubble (share of total time)")
    ax.set_title("Bubble (p−1)/(v·m+p−1)", loc="left", fontsize=10)
    markers = [Line2D([], [], color="grey", label="theory"),
               Line2D([], [], color="grey", marker="o", markerfacecolor="none",
                      linestyle="", label="simulated")]
    if measured:
        markers.append(Line2D([], [], color="grey", marker="x", markeredgewidth=2,
                              linestyle="", label="measured"))
    handles, _ = ax.get_legend_handles_labels()
    ax.legend(handles=handles + markers, frameon=False, fontsize=8,
              loc="upper left", bbox_to_anchor=(1.0, 1.0))
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    return ax
