"""Regenerate the figures in images/: ``python -m pipeline_lib.viz.figures images/``.

Every figure comes from the simulator (no timing), so the PNGs are the same on every
machine and a change in a schedule shows up as a change in its picture.
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Sequence

from matplotlib.figure import Figure

from pipeline_lib.viz.plot import bubble_vs_microbatches, gantt
from pipeline_lib.schedules import gpipe, interleaved_1f1b, one_f_one_b, zb_h1
from pipeline_lib.timeline import Timeline, simulate

RANKS, MICROBATCHES, VIRTUAL_STAGES = 4, 8, 2


def schedule_timelines(p: int = RANKS, m: int = MICROBATCHES,
                       v: int = VIRTUAL_STAGES) -> dict[str, Timeline]:
    """The steps the README draws, with backward = 2 × forward.

    A rank's v virtual stages are 1/v of a stage each, so they cost 1/v as much: all
    charts then show the same model on the same time axis. ZB-H1 splits each backward into I = W = F.
    """
    timelines = {
        "naive": simulate(gpipe(p, 1)),
        "gpipe": simulate(gpipe(p, m)),
        "1f1b": simulate(one_f_one_b(p, m)),
        "interleaved_1f1b": simulate(interleaved_1f1b(p, m, v), forward=1 / v,
                                     backward=2 / v),
        "zb_h1": simulate(zb_h1(p, m), weight=1.0),
    }
    timelines["naive"].title = f"Naive model parallelism, p={p}, one batch"
    for name in ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1"):
        timelines[name].title += f", p={p}, m={m}"
    return timelines


def _save(fig: Figure, path: Path) -> Path:
    """Draw into a file beside ``path``, then rename it over ``path``: a full disk or a
    kill mid-write leaves the last good PNG whole, never a truncated one."""
    partial = path.with_name(f".{path.name}.{os.getpid()}.part")
    try:
        fig.savefig(partial, format="png", dpi=130, bbox_inches="tight")
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
    return path


def write_figures(directory: str | Path) -> list[Path]:
    """Write every figure into ``directory`` (created if missing); return the paths."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    timelines = schedule_timelines()
    written = []
    for name, timeline in timelines.items():
        fig = Figure(figsize=(10, 0.45 * timeline.ranks + 1.3))
        gantt(timeline, ax=fig.subplots())
        written.append(_save(fig, out / f"{name}.png"))

    compared = ["gpipe", "1f1b", "interleaved_1f1b", "zb_h1"]
    fig = Figure(figsize=(10, 2.1 * len(compared)), layout="constrained")
    axes = fig.subplots(len(compared), 1, sharex=True)
    for ax, name in zip(axes, compared):
        gantt(timelines[name], ax=ax)
    for ax in axes[:-1]:
        ax.set_xlabel("")
    axes[-1].set_xlim(0, max(timelines[name].makespan for name in compared))  # shared
    written.append(_save(fig, out / "schedules.png"))

    fig = Figure(figsize=(7, 4))
    bubble_vs_microbatches([2, 4, 8], [1, 2, 3, 4, 6, 8, 12, 16, 24, 32], [1, 2],
                           ax=fig.subplots())
    written.append(_save(fig, out / "bubble_vs_microbatches.png"))
    return written


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", nargs="?", default="images",
                        help="where to write the PNGs (default: images)")
    for path in write_figures(parser.parse_args(argv).directory):
        print(path)


if __name__ == "__main__":
    main()
