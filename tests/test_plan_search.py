"""`search`: every layout it enumerates is priced or rejected with its reason, its memory
is `predict`'s, and it finds what practitioners chose, or a layout it prices at least
as fast that fits."""
from __future__ import annotations

import pytest

from pipeline_lib.plan import CLUSTERS, Model, predict, search
from pipeline_lib.plan.published import BY_NAME
from pipeline_lib.plan.search import Rejected, differences, layouts

A100, H100 = CLUSTERS["A100-80GB"], CLUSTERS["H100-80GB"]


def test_a_sequence_that_tp_does_not_divide_is_priced_without_sequence_parallelism():
    """Issue 37: sequence parallelism with a tp that does not divide the sequence raised
    inside `predict` (583 of 2,996 layouts of one search). Every enumerated layout is
    now priced or rejected, sequence parallelism only where tp divides the sequence."""
    model = Model(layers=12, hidden=2048, heads=16, seq_len=1020, vocab=32000)
    enumerated = [layout for layout, _ in layouts(model, 16, 64, ("1f1b", "interleaved_1f1b"),
                                                  ("none", "full"), None, False)]
    result = search(model, A100, 16, 64, schedules=("1f1b", "interleaved_1f1b"),
                    recompute=("none", "full"))
    assert len(result.ranked) + len(result.rejected) == len(enumerated)
    assert all(r.reason for r in result.rejected)
    for candidate in result.ranked:
        layout = candidate.layout
        assert layout.sequence_parallel == (layout.tp > 1 and 1020 % layout.tp == 0)
    assert any(c.layout.tp == 8 for c in result.ranked)          # 1020 / 8 is not whole


def test_listed_memory_is_predicts_and_fits():
    """Issue 35, item 6: a 16-layer model (h 4096, sequence 8192, vocabulary 256k) on 16
    GPUs listed 24 of 530 layouts at 61.9 GiB that `predict` put at 92.9 GiB. One memory
    function now: every listed layout's memory is `predict`'s, and fits."""
    model = Model(layers=16, hidden=4096, heads=32, seq_len=8192, vocab=256000)
    result = search(model, A100, 16, 64, flash_attention=True)
    assert result.ranked
    for candidate in result.ranked[::max(1, len(result.ranked) // 40)]:
        plan = predict(model, A100, candidate.layout)
        assert float(candidate.memory) == pytest.approx(float(plan.memory), rel=1e-12)
        assert plan.fits
    for rejected in result.rejected:
        if rejected.layout is not None and "needs" in rejected.reason:
            assert not predict(model, A100, rejected.layout).fits


@pytest.mark.parametrize("kwargs, message", [
    (dict(micro_batches=(0,)), r"micro_batches\) must be a positive integer, got 0"),
    (dict(micro_batches=(2.5,)), "must be a positive integer"),
    (dict(gpus=8.0), r"gpus must be a positive integer, got 8.0 .a float: pass int"),
    (dict(gpus=0), "gpus must be a positive integer"),
    (dict(global_batch=True), "global_batch must be a positive integer"),
    (dict(schedules=("1f1f",)), "unknown schedule '1f1f'"),
    (dict(recompute=("most",)), "recompute 'most' is not one of"),
    (dict(context_parallel=(0,)), "context_parallel"),
    (dict(fp8=True), "fp8=True needs a cluster with fp8_flops"),
])
def test_bad_arguments_are_refused_with_what_to_change(kwargs, message):
    model = Model(layers=4, hidden=256, heads=4, seq_len=128, vocab=1000)
    arguments = dict(model=model, cluster=A100, gpus=8, global_batch=16) | kwargs
    with pytest.raises(ValueError, match=message):
        search(**arguments)


def test_micro_batches_that_divide_no_replica_batch_are_rejected_with_the_reason():
    model = Model(layers=4, hidden=256, heads=4, seq_len=128, vocab=1000)
    result = search(model, A100, 8, 16, micro_batches=(3,))
    assert not result.ranked
    assert any("no micro-batch size of [3]" in r.reason for r in result.rejected)


@pytest.fixture(scope="module")
def llama() -> tuple:
    run = BY_NAME["Llama 3 405B, 8192 GPUs"]
    return run, search(run.model, H100, 8192, 2048, flash_attention=True)


def test_finds_llama_3s_layout_or_one_at_least_as_fast_that_fits(llama):
    """Issue 37: the planner priced Llama 3 405B's own layout (TP 8, PP 16, DP 64,
    interleaved v 8 with the first and last chunks holding only the embedding and the
    loss, FSDP) faster than the one its search returned. Now the search's best fits and
    is priced at least as fast as the published one, and the published layout (its
    sizes, schedule and split) is among the listed."""
    run, result = llama
    published = predict(run.model, H100, run.layout)
    best = result.best
    assert best.plan is not None and best.plan.fits
    assert best.step_time <= published.step_time
    same_shape = [c for c in result.ranked
                  if (c.layout.tp, c.layout.pp, c.layout.dp, c.layout.virtual_stages,
                      c.layout.schedule, c.layout.recompute) == (8, 16, 64, 8,
                                                                 "interleaved_1f1b", "none")]
    assert same_shape, "the published shape is not listed"


def test_the_space_holds_uneven_splits_and_sharded_data(llama):
    """v that does not divide the layers (126 layers in 16 × 8 chunks), the first and the
    last stage with a layer fewer, and ZeRO stages 1 to 3 (FSDP keeping its weights)."""
    _, result = llama
    listed = [c.layout for c in result.ranked]
    assert any(126 % l.chunks for l in listed)
    assert any(l.first_stage_layers is not None for l in listed)
    assert {l.zero_stage for l in listed} >= {1, 2, 3}
    assert any(l.shard_parameters and not l.reshard_after_forward for l in listed)


def test_ranked_by_time_and_every_rejection_has_a_reason():
    model = Model(layers=96, hidden=12288, heads=96, seq_len=2048, vocab=51200)
    result = search(model, A100, 64, 64)
    simulated = [c for c in result.ranked if c.plan is not None]
    times = [c.step_time for c in simulated]
    assert times == sorted(times) and len(simulated) == 4
    closed_form = [c.step_time for c in result.ranked[4:]]
    assert closed_form == sorted(closed_form)
    assert all(c.memory <= A100.hbm_bytes for c in result.ranked)
    assert any("needs" in r.reason for r in result.rejected)                  # too big
    assert any("does not divide heads" in r.reason for r in result.rejected)  # tp 64
    assert all(isinstance(r, Rejected) and r.reason for r in result.rejected)


@pytest.mark.parametrize("name", ["39.1B", "NeMo GPT 5B, 64 GPUs"])
def test_finds_a_layout_at_least_as_fast_as_the_published_one(name):
    run = BY_NAME[name]
    published = predict(run.model, A100, run.layout)
    result = search(run.model, A100, run.layout.gpus, run.layout.global_batch)
    best = result.best
    assert best.plan is not None and best.plan.fits
    assert best.step_time <= published.step_time * 1.0001
    assert best.layout.gpus == run.layout.gpus
    assert differences(best.layout, run.layout) != "same layout" \
        or best.step_time == pytest.approx(published.step_time)
