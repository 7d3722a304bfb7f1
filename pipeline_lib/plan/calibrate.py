"""Fit a GPU type's two efficiency factors to a few measured runs, and nothing else.

The presets in `hardware` hold the result of this fit on the runs that
``plan.published.CALIBRATION`` names (at most a third of its published rows): that test runs
the fit again and checks that the presets are its result, so every constant of the
planner is either on a spec sheet or reproducible from named runs.
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Sequence

from pipeline_lib.plan.hardware import Cluster
from pipeline_lib.plan.model import Layout, Model
from pipeline_lib.plan.predict import predict

FACTORS = ("matmul_efficiency", "bandwidth_efficiency")


def log_error(cluster: Cluster, runs: Sequence[tuple[Model, Layout, float]]) -> float:
    """Sum of squared log ratios of predicted to measured step time: a 10% miss either
    way costs the same."""
    return sum(math.log(predict(model, cluster, layout).step_time / seconds) ** 2
               for model, layout, seconds in runs)


def calibrate(cluster: Cluster, runs: Sequence[tuple[Model, Layout, float]],
              factors: Sequence[str] = FACTORS, resolution: float = 0.01) -> Cluster:
    """``cluster`` with ``factors`` set (each in [0.2, 1], to ``resolution``) to minimise
    `log_error` over ``runs`` of (model, layout, measured seconds per step).

    A golden-section search over the first factor, each of its trials taking the best
    second factor (a golden-section search again). The two trade off against each other
    (a slower GEMM or slower memory both lengthen a step), so a search one factor at a
    time would stop wherever it started on that ridge; nested, the result does not depend
    on the cluster's current values."""
    if not runs:
        raise ValueError("calibrate needs at least one measured run")
    unknown = set(factors) - set(FACTORS)
    if unknown or not 1 <= len(factors) <= 2:
        raise ValueError(f"calibrate fits one or two of {FACTORS}, not {list(factors)}")

    def best(fixed: Cluster, remaining: Sequence[str]) -> tuple[float, Cluster]:
        factor, rest = remaining[0], remaining[1:]

        def trial(x: float) -> tuple[float, Cluster]:
            candidate = replace(fixed, **{factor: round(x / resolution) * resolution})
            return best(candidate, rest) if rest else (log_error(candidate, runs), candidate)

        lo, hi = 0.2, 1.0
        while hi - lo > resolution / 2:
            a, b = hi - GOLDEN * (hi - lo), lo + GOLDEN * (hi - lo)
            lo, hi = (lo, b) if trial(a)[0] < trial(b)[0] else (a, hi)
        return trial((lo + hi) / 2)

    return best(cluster, list(factors))[1]


GOLDEN = (math.sqrt(5) - 1) / 2
