"""The planner on this machine: a `Cluster` measured here, priced like a GPU cluster."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from pipeline_lib.lm.loops import lm_loss
from pipeline_lib.lm.model import transformer_lm
from pipeline_lib.plan import Kernels, Layout, Model, Work, predict
from pipeline_lib.plan.kernels import count_kernels, counted
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
    assert 0 < cluster.kernel_overhead < 1e-3 and 0 < cluster.action_overhead < 1e-2
    assert 0 < cluster.send_overhead < 0.1 and cluster.receive_overhead == 0  # no block
    # messages free: what is left of the bubble is fill and drain, whatever the load
    # that the measured latency saw (on a busy machine a message waits milliseconds)
    computing = replace(cluster, latency=0.0, send_overhead=0.0)
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


def _lm(dropout: float) -> torch.nn.Sequential:
    torch.manual_seed(0)
    return transformer_lm(1000, d_model=64, nhead=4, d_hid=128, nlayers=4, dropout=dropout)


def _counted(dropout: float) -> Kernels:
    ids = torch.randint(0, 1000, (4, 16))
    return count_kernels(_lm(dropout), ids, torch.randint(0, 1000, (4, 16)), lm_loss)


def test_kernels_are_counted_on_the_real_modules():
    """The counts follow the modules: dropout adds operations to every block's forward
    and backward; a backward dispatches more than its forward (input and weight
    gradients) and multiplies twice as much; the FLOPs are the model's multiplies."""
    plain, dropping = _counted(0.0), _counted(0.2)
    assert plain.tokens == 64
    assert dropping.block[0].ops > plain.block[0].ops
    assert dropping.block[1].ops > plain.block[1].ops
    forward, backward = plain.block
    assert backward.ops > forward.ops > 0
    # query-key-value, output and the MLP's two projections, 2 FLOPs per multiply-add
    # (the fused CPU attention kernel is not a multiply PyTorch counts)
    assert forward.flops == 2 * 64 * (64 * 192 + 64 * 64 + 2 * 64 * 128)
    assert backward.flops == 2 * forward.flops
    assert plain.head[0].flops == 2 * 64 * 64 * 1000           # the vocabulary projection
    assert plain.embedding[0].flops == 0 and plain.embedding[0].nbytes > 0
    assert forward.gemm_bytes > 4 * 64 * 192 * 64 // 64      # at least the weights it reads


def test_backwards_are_counted_adding_into_the_gradients_and_leave_them_as_they_were():
    """A step's later micro-batches add their weight gradients into the earlier ones'
    (read two, write one): the counted backward moves more bytes than a first one. The
    model's ``.grad`` is put back as it was, set or not."""
    lm = _lm(0.0)
    ids = torch.randint(0, 1000, (4, 16))
    x = lm[0](ids).detach().requires_grad_()
    out = lm[1](x)
    first = counted(lambda: out.backward(torch.ones_like(out)))
    lm.zero_grad(set_to_none=True)
    kept = torch.full_like(lm[1].layer.linear1.weight, 3.0)
    lm[1].layer.linear1.weight.grad = kept
    later = count_kernels(lm, ids, ids, lm_loss).block[1]
    assert later.nbytes > first.nbytes and later.flops == first.flops
    assert lm[1].layer.linear1.weight.grad is kept and torch.all(kept == 3.0)
    assert all(p.grad is None for name, p in lm.named_parameters()
               if name != "1.layer.linear1.weight")


def test_each_counted_operation_costs_its_overhead(cluster):
    """With counted kernels each forward operation adds ``kernel_overhead`` and each
    backward one ``backward_overhead``: a middle block's passes grow by exactly their
    counts."""
    work = Work(ops=50, flops=1e6, gemm_bytes=1e5, nbytes=1e5)
    back = Work(ops=90, flops=2e6, gemm_bytes=2e5, nbytes=2e5)
    small = (Work(ops=4, nbytes=1e4), Work(ops=3, nbytes=1e4))
    model = replace(QUICK, kernels=Kernels(block=(work, back), embedding=small,
                                           head=small, tokens=4 * 16))
    layout = Layout(pp=4, micro_batch=4, global_batch=16)     # one block per chunk
    free = predict(model, replace(cluster, kernel_overhead=0.0, backward_overhead=0.0),
                   layout).costs
    paid = predict(model, replace(cluster, kernel_overhead=1e-5, backward_overhead=3e-6),
                   layout).costs
    middle = 1
    assert paid.forward[middle] - free.forward[middle] == pytest.approx(50 * 1e-5)
    assert paid.backward[middle] - free.backward[middle] == pytest.approx(90 * 3e-6)
    assert paid.forward[0] - free.forward[0] == pytest.approx((50 + 4) * 1e-5)


def test_kernels_counted_at_another_micro_batch_are_refused(cluster):
    model = replace(QUICK, kernels=_counted(0.0))          # 4 sequences of 16 tokens
    with pytest.raises(ValueError, match="counted on one device at micro-batches of 64"):
        predict(model, cluster, Layout(pp=2, micro_batch=2, global_batch=16))
    with pytest.raises(ValueError, match="tp = 2"):
        predict(model, cluster, Layout(tp=2, pp=2, micro_batch=4, global_batch=16))


@pytest.mark.parametrize("schedule, pp", [("gpipe", 4), ("zb_v", 2)])
def test_messages_cost_their_two_ends_and_each_action_its_overhead(cluster, schedule, pp):
    """A forward pays the send overhead where the next chunk is on another rank and the
    receive overhead where the previous one is, a backward the other way round, and
    every action the executor's own overhead; a V schedule's turn, two chunks on one
    rank, pays no message."""
    layout = Layout(pp=pp, micro_batch=4, global_batch=16, schedule=schedule)
    quiet = replace(cluster, action_overhead=0.0, send_overhead=0.0, receive_overhead=0.0)
    send, receive, action = 1e-3, 1e-2, 1e-1
    loud = replace(quiet, action_overhead=action, send_overhead=send,
                   receive_overhead=receive)
    plans = [predict(QUICK, c, layout) for c in (quiet, loud)]
    chunks = len(plans[0].costs.forward)
    rank_of = {c: c for c in range(chunks)} if schedule == "gpipe" else {0: 0, 1: 1, 2: 1, 3: 0}
    for c in range(chunks):
        sends = c < chunks - 1 and rank_of[c + 1] != rank_of[c]
        receives = c > 0 and rank_of[c - 1] != rank_of[c]
        assert plans[1].costs.forward[c] - plans[0].costs.forward[c] == \
            pytest.approx(action + send * sends + receive * receives)
        assert plans[1].costs.backward[c] - plans[0].costs.backward[c] == \
            pytest.approx(action + send * receives + receive * sends)
        assert plans[1].costs.weight[c] == plans[0].costs.weight[c]
    assert plans[1].pipeline_time > plans[0].pipeline_time


def test_work_refuses_negative_counts():
    with pytest.raises(ValueError, match="ops must be an integer"):
        Work(ops=-1)
    with pytest.raises(ValueError, match="flops, gemm_bytes"):
        Work(ops=1, nbytes=-1.0)
    with pytest.raises(ValueError, match="forward, backward"):
        Kernels(block=(Work(1),), embedding=(Work(1), Work(1)), head=(Work(1), Work(1)),
                tokens=1)
