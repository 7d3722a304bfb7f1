"""Fit a GPU type's two efficiency factors to a few measured runs, and nothing else.

The presets in `hardware` hold the result of this fit on the runs that
``tests/test_plan.py`` names (at most a third of its published rows): that test runs
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
    """``cluster`` with ``factors`` set (in [0.2, 1], to ``resolution``) to minimise
    `log_error` over ``runs`` of (model, layout, measured seconds per step): a golden
    section search on each factor in turn, until neither moves."""
    if not runs:
        raise ValueError("calibrate needs at least one measured run")
    unknown = set(factors) - set(FACTORS)
    if unknown:
        raise ValueError(f"calibrate fits only {FACTORS}, not {sorted(unknown)}")
    golden = (math.sqrt(5) - 1) / 2
    for _ in range(8):
        before = [getattr(cluster, f) for f in factors]
        for factor in factors:
            cost = lambda x: log_error(replace(cluster, **{factor: x}), runs)
            lo, hi = 0.2, 1.0
            while hi - lo > resolution / 4:
                a, b = hi - golden * (hi - lo), lo + golden * (hi - lo)
                lo, hi = (lo, b) if cost(a) < cost(b) else (a, hi)
            cluster = replace(cluster, **{factor: round((lo + hi) / 2 / resolution)
                                          * resolution})
        if [getattr(cluster, f) for f in factors] == before:
            break
    return cluster
