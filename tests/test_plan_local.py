"""The planner on this machine: a `Cluster` measured here, priced like a GPU cluster."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from pipeline_lib.lm.loops import lm_loss
from pipeline_lib.lm.model import transformer_lm
from pipeline_lib.plan import Dispatches, Layout, Model, predict
from pipeline_lib.plan.local import count_dispatches, measure_local_cluster

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
    # messages free: what is left of the bubble is fill and drain, whatever the load
    # that the measured latency saw (on a busy machine a message waits milliseconds)
    computing = replace(cluster, latency=0.0)
    bubble = {}
    for schedule in ("gpipe", "1f1b"):
        for m in (4, 8):
            plan = predict(QUICK, computing, Layout(pp=2, micro_batch=16 // m,
                                                    global_batch=16, schedule=schedule,
                                                    flash_attention=True))
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


def _counted(dropout: float) -> Dispatches:
    torch.manual_seed(0)
    lm = transformer_lm(1000, d_model=64, nhead=4, d_hid=128, nlayers=4, dropout=dropout)
    ids = torch.randint(0, 1000, (4, 16))
    return count_dispatches(lm, ids, torch.randint(0, 1000, (4, 16)), lm_loss)


def test_dispatches_are_counted_on_the_real_modules():
    """The counts follow the modules: dropout adds operations to every block's forward
    and backward; a backward dispatches more than its forward (input and weight
    gradients); the head's backward runs the loss's and the projection's."""
    plain, dropping = _counted(0.0), _counted(0.2)
    assert dropping.block[0] > plain.block[0] and dropping.block[1] > plain.block[1]
    assert plain.block[1] > plain.block[0] > 0
    assert plain.head[1] > 0 and plain.embedding[0] > 0


def test_each_counted_dispatch_costs_the_kernel_overhead(cluster):
    """With counted dispatches, the roofline prices bytes and FLOPs and each operation
    adds ``kernel_overhead`` once: a middle block's forward grows by exactly its count."""
    counts = Dispatches(block=(50, 90), embedding=(4, 3), head=(10, 17))
    model = replace(QUICK, dispatches=counts)
    layout = Layout(pp=4, micro_batch=4, global_batch=16)     # one block per chunk
    free, paid = (predict(model, replace(cluster, kernel_overhead=k), layout).costs
                  for k in (0.0, 1e-5))
    middle = 1
    assert paid.forward[middle] - free.forward[middle] == pytest.approx(50 * 1e-5)
    assert paid.backward[middle] - free.backward[middle] == pytest.approx(90 * 1e-5)
    assert paid.forward[0] - free.forward[0] == pytest.approx((50 + 4) * 1e-5)
