"""The planner on this machine: a `Cluster` measured here, priced like a GPU cluster."""
from __future__ import annotations

from dataclasses import replace

import pytest

from pipeline_lib.plan import Layout, Model, predict
from pipeline_lib.plan.local import measure_local_cluster

# bench/bench_distributed.py's --quick model, 2 ranks, global batch 16
QUICK = Model(layers=4, hidden=64, heads=4, seq_len=16, vocab=1000, ffn_hidden=128)


@pytest.fixture(scope="module")
def cluster():
    return measure_local_cluster(threads=1, ranks=2)


def test_measured_cluster_predicts_the_two_rank_runs(cluster):
    assert cluster.value_bytes == 4 and cluster.gpus_per_node == 2
    assert cluster.peak_flops > 1e8 and cluster.hbm_bandwidth > 1e8
    assert cluster.intra_node_bandwidth > 1e6 and 0 < cluster.latency < 0.1
    assert 0 < cluster.kernel_overhead < 1e-3
    bubble = {}
    for schedule in ("gpipe", "1f1b"):
        for m in (4, 8):
            plan = predict(QUICK, cluster, Layout(pp=2, micro_batch=16 // m, global_batch=16,
                                                  schedule=schedule, flash_attention=True))
            bubble[schedule, m] = plan.bubble_fraction
            assert 0 < plan.pipeline_time < plan.step_time
            assert plan.timeline.ranks == 2
    # more micro-batches, a smaller share of fill and drain
    assert bubble["gpipe", 8] < bubble["gpipe", 4] and bubble["1f1b", 8] < bubble["1f1b", 4]


def test_kernel_overhead_adds_a_fixed_cost_per_kernel(cluster):
    """A kernel's time is its roofline plus the overhead: doubling the overhead doubles
    what it adds to each action."""
    layout = Layout(pp=2, micro_batch=4, global_batch=16)
    base, once, twice = (predict(QUICK, replace(cluster, kernel_overhead=k), layout).costs
                         for k in (0.0, 1e-5, 2e-5))
    for a, b, c in zip(base.forward, once.forward, twice.forward):
        assert b > a and abs((c - a) - 2 * (b - a)) < 1e-12
