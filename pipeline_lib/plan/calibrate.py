"""Fit a GPU type's two efficiency factors to a few measured runs, and nothing else.

The presets in `hardware` hold the result of this fit on the runs that
``plan.published.CALIBRATION`` names (a third of each GPU type's published rows): the
tests check that the presets are its optimum, and ``bench/bench_plan.py --refit`` fits
each other third too, to show how far the factors move. Every constant of the planner
is either on a spec sheet or reproducible from named runs.
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Sequence

from pipeline_lib.plan.hardware import Cluster
from pipeline_lib.plan.model import Layout, Model
from pipeline_lib.plan.predict import predict

FACTORS = ("matmul_efficiency", "bandwidth_efficiency")
Runs = Sequence[tuple[Model, Layout, float]]


def log_error(cluster: Cluster, runs: Runs) -> float:
    """Sum of squared log ratios of predicted to measured step time: a 10% miss either
    way costs the same."""
    return sum(math.log(predict(model, cluster, layout).step_time / seconds) ** 2
               for model, layout, seconds in runs)


def _clamp(x: float) -> float:
    return min(1.0, max(0.2, x))


def calibrate(cluster: Cluster, runs: Runs, factors: Sequence[str] = FACTORS,
              resolution: float = 0.01) -> Cluster:
    """``cluster`` with ``factors`` set (each in [0.2, 1], on a grid of ``resolution``) to
    minimise `log_error` over ``runs`` of (model, layout, measured seconds per step).

    Gauss-Newton on the runs' log errors, the factors' reciprocals as unknowns (a step
    time is nearly a sum of FLOPs over one and bytes over the other), from the middle of
    the range, so the result does not depend on the cluster's current values; then
    rounded to the grid and moved to the best neighbour until none is better: the
    result is a minimum on the grid, which the tests check the presets are."""
    if not runs:
        raise ValueError("calibrate needs at least one measured run")
    unknown = set(factors) - set(FACTORS)
    if unknown or not 1 <= len(factors) <= 2:
        raise ValueError(f"calibrate fits one or two of {FACTORS}, not {list(factors)}")
    factors = list(factors)

    def with_values(values: Sequence[float]) -> Cluster:
        return replace(cluster, **{f: _clamp(v) for f, v in zip(factors, values)})

    def residuals(values: Sequence[float]) -> list[float]:
        trial = with_values(values)
        return [math.log(predict(m, trial, l).step_time / s) for m, l, s in runs]

    x = [1 / 0.6] * len(factors)                        # reciprocals of the factors
    for _ in range(8):
        r = residuals([1 / v for v in x])
        columns = []
        for k in range(len(x)):
            bumped = list(x)
            bumped[k] *= 1.01
            columns.append([(b - a) / (0.01 * x[k])
                            for a, b in zip(r, residuals([1 / v for v in bumped]))])
        step = _least_squares(columns, [-v for v in r])
        x = [min(5.0, max(1.0, v + d)) for v, d in zip(x, step)]
        if max(abs(d) / v for v, d in zip(x, step)) < 1e-3:
            break
    grid = [round(_clamp(1 / v) / resolution) for v in x]
    best = log_error(with_values([g * resolution for g in grid]), runs)
    while True:
        neighbours = [[g + d if k == i else g for k, g in enumerate(grid)]
                      for i in range(len(grid)) for d in (-1, 1)]
        scored = [(log_error(with_values([g * resolution for g in n]), runs), n)
                  for n in neighbours if all(0.2 <= g * resolution <= 1.0 for g in n)]
        error, candidate = min(scored)
        if error >= best:
            return with_values([g * resolution for g in grid])
        best, grid = error, candidate


def _least_squares(columns: list[list[float]], target: list[float]) -> list[float]:
    """The x minimising |J x − target|² for J given by its ``columns`` (one or two)."""
    if len(columns) == 1:
        a = columns[0]
        return [sum(u * t for u, t in zip(a, target)) / sum(u * u for u in a)]
    a, b = columns
    aa, ab, bb = (sum(u * v for u, v in zip(p, q)) for p, q in ((a, a), (a, b), (b, b)))
    at, bt = (sum(u * t for u, t in zip(p, target)) for p in (a, b))
    det = aa * bb - ab * ab
    if abs(det) < 1e-12 * aa * bb:                  # the runs tell only one direction
        return [at / aa, 0.0]
    return [(at * bb - bt * ab) / det, (bt * aa - at * ab) / det]
