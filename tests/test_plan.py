"""pipeline_lib.plan against published training runs, and its memory formulas.

Each run's step time is derived from its published throughput with the paper's own FLOP
formula. The two efficiency factors of each GPU type are fitted on CALIBRATION (four of
the twelve rows: a third) and the error is asserted on the other eight.
"""
from __future__ import annotations

import statistics
from dataclasses import replace

import pytest

from pipeline_lib.plan import CLUSTERS, Layout, Model, predict, search
from pipeline_lib.plan.calibrate import calibrate
from pipeline_lib.plan.costs import ring_seconds
from pipeline_lib.plan.published import BY_NAME, CALIBRATION, RUNS
from pipeline_lib.plan.memory import activation_terms, layer_activation_bytes, state_bytes
from pipeline_lib.plan.predict import chunk_parameters
from pipeline_lib.plan.search import differences
from pipeline_lib.timeline import Timeline

A100, H100 = CLUSTERS["A100-80GB"], CLUSTERS["H100-80GB"]
HELD_OUT = [run for run in RUNS if run.name not in sum(CALIBRATION.values(), [])]


def test_calibration_is_a_third_of_the_rows():
    assert 3 * sum(map(len, CALIBRATION.values())) <= len(RUNS)


@pytest.mark.parametrize("cluster_name, factors", [
    ("A100-80GB", ("matmul_efficiency", "bandwidth_efficiency")),
    ("H100-80GB", ("matmul_efficiency",))])
def test_presets_hold_the_fit_on_the_named_rows(cluster_name, factors):
    preset = CLUSTERS[cluster_name]
    start = replace(preset, **{f: 0.5 for f in factors})     # forget the preset's values
    runs = [(BY_NAME[n].model, BY_NAME[n].layout, BY_NAME[n].step_time)
            for n in CALIBRATION[cluster_name]]
    fitted = calibrate(start, runs, factors)
    for f in factors:
        assert getattr(fitted, f) == pytest.approx(getattr(preset, f), abs=0.011), f


def test_step_time_of_held_out_published_runs():
    errors = {}
    for run in HELD_OUT:
        plan = predict(run.model, CLUSTERS[run.cluster_name], run.layout)
        errors[run.name] = plan.step_time / run.step_time - 1
    table = "\n".join(f"{name:>24}: {error:+.1%}" for name, error in errors.items())
    absolute = [abs(e) for e in errors.values()]
    assert statistics.median(absolute) <= 0.10, table
    assert max(absolute) <= 0.25, table


def test_fraction_of_peak_grows_with_hidden_size():
    """Table 1's 44% at h = 2304 and 52% at h = 25600 come from the elementwise work
    that the roofline prices, though the largest runs have the biggest bubble."""
    small = predict(BY_NAME["1.7B"].model, A100, BY_NAME["1.7B"].layout)
    large = predict(BY_NAME["1008B"].model, A100, BY_NAME["1008B"].layout)
    assert large.bubble_fraction > small.bubble_fraction
    assert large.tflops_per_gpu > 1.1 * small.tflops_per_gpu


GPT_175B = Model(layers=96, hidden=12288, heads=96, seq_len=2048, vocab=51200)


def test_interleaving_gains_at_small_batch_and_loses_its_edge_at_large():
    """Narayanan et al. 2021, Fig. 12: GPT 175B on 96 GPUs (t = 8, p = 12), micro-batch 1;
    the interleaved schedule's lead over 1F1B closes as the batch grows."""
    def gain(batch: int) -> float:
        def step(schedule: str, v: int) -> float:
            return predict(GPT_175B, A100, Layout(
                tp=8, pp=12, dp=1, micro_batch=1, global_batch=batch, virtual_stages=v,
                schedule=schedule, recompute="full")).step_time
        return step("1f1b", 1) / step("interleaved_1f1b", 2)

    gains = [gain(b) for b in (12, 24, 48, 96, 240)]
    assert gains[0] > 1.15
    assert all(a > b for a, b in zip(gains, gains[1:])), gains
    assert gains[-1] < 1.05


@pytest.mark.parametrize("batch", [32, 128])
def test_tensor_parallel_within_a_node_is_best_at_fixed_gpus(batch):
    """Narayanan et al. 2021, Sec. 5.4.1 and Fig. 13: a 162.2B GPT (32 layers, h = 20480,
    128 heads; NVIDIA/Megatron-LM examples/academic_paper_scripts/sc21/run_figure_13.sh:
    micro-batch 1, full recompute, batch 32 and 128) on 64 A100s (8 per node), as
    (t, p) = (2, 32), (4, 16), (8, 8), (16, 4), (32, 2). Throughput peaks at t = 8, the
    GPUs of a node, and falls off both ways: below it the pipeline's bubble grows with p,
    above it the tensor-parallel all-reduces cross the slower inter-node links."""
    model = Model(layers=32, hidden=20480, heads=128, seq_len=2048, vocab=51200)
    throughput = {t: predict(model, A100, Layout(
        tp=t, pp=64 // t, dp=1, micro_batch=1, global_batch=batch,
        recompute="full")).tflops_per_gpu for t in (2, 4, 8, 16, 32)}
    shown = {t: round(x, 1) for t, x in throughput.items()}
    assert max(throughput, key=throughput.get) == 8, shown
    assert throughput[2] < throughput[4] < throughput[8], shown
    assert throughput[8] > throughput[16] > throughput[32], shown


def test_zb_h1_beats_1f1b_at_equal_memory():
    def plan(schedule: str):
        return predict(GPT_175B, A100, Layout(tp=8, pp=12, dp=1, micro_batch=1,
                                              global_batch=48, schedule=schedule,
                                              recompute="full"))
    one_f_one_b, zb_h1 = plan("1f1b"), plan("zb_h1")
    assert zb_h1.step_time < 0.97 * one_f_one_b.step_time
    assert zb_h1.bubble_fraction < one_f_one_b.bubble_fraction
    assert zb_h1.memory == pytest.approx(one_f_one_b.memory, rel=0.02)


def test_plan_carries_the_simulated_timeline_of_the_named_schedule():
    layout = Layout(tp=8, pp=4, dp=2, micro_batch=1, global_batch=16, virtual_stages=2,
                    schedule="interleaved_1f1b", recompute="full")
    plan = predict(GPT_175B, A100, layout)
    assert isinstance(plan.timeline, Timeline)
    assert plan.timeline.ranks == 4 and plan.timeline.title.startswith("Interleaved 1F1B")
    assert len(plan.timeline.events) == 4 * 2 * 8 * 2       # ranks × chunks × m × (F, B)
    assert plan.bubble_fraction == plan.timeline.bubble_fraction()
    assert plan.step_time >= plan.timeline.makespan
    assert 0 < plan.mfu < plan.tflops_per_gpu * 1e12 / A100.peak_flops < 1


def test_full_recompute_adds_one_forward_to_each_backward():
    layout = Layout(tp=8, pp=4, dp=1, micro_batch=1, global_batch=8, recompute="none")
    plain = predict(GPT_175B, A100, layout).costs
    full = predict(GPT_175B, A100, replace(layout, recompute="full")).costs
    middle = 1                                  # no embedding, no loss
    assert full.forward == plain.forward
    assert full.backward[middle] == pytest.approx(plain.backward[middle]
                                                  + plain.forward[middle])


def test_data_parallel_reduction_hides_partly_behind_the_last_backwards():
    """On a network 20 times slower the reduction shows, but less of it than a ring of
    the busiest rank's gradients takes: it overlaps with the last backwards."""
    layout = Layout(tp=8, pp=4, dp=4, micro_batch=1, global_batch=32, recompute="full")
    slow = replace(A100, inter_node_bandwidth=A100.inter_node_bandwidth / 20)
    plan = predict(GPT_175B, slow, layout)
    params = chunk_parameters(GPT_175B, layout, plan.costs.layers)
    ring = ring_seconds(2 * max(params), 4, slow.link_bandwidth(inter_node=True),
                        slow.latency)
    assert 0 < plan.data_parallel_time < ring
    assert predict(GPT_175B, A100, layout).data_parallel_time < plan.data_parallel_time


# -- memory formulas ----------------------------------------------------------------------

@pytest.mark.parametrize("tp, sp, recompute, per_sbh", [
    (1, False, "none", lambda a, s, h, t: 34 + 5 * a * s / h),
    (8, False, "none", lambda a, s, h, t: 10 + 24 / t + 5 * a * s / (h * t)),
    (8, True, "none", lambda a, s, h, t: 34 / t + 5 * a * s / (h * t)),
    (8, True, "selective", lambda a, s, h, t: 34 / t),
    (8, False, "selective", lambda a, s, h, t: 10 + 24 / t),
    (8, True, "full", lambda a, s, h, t: 2),
])
def test_activations_per_layer_are_korthikanti_table_2(tp, sp, recompute, per_sbh):
    """Korthikanti et al. 2022, 'Reducing Activation Recomputation in Large Transformer
    Models', Table 2: bytes per layer as s·b·h times the listed factor."""
    b = 2
    layout = Layout(tp=tp, micro_batch=b, global_batch=b, recompute=recompute,
                    sequence_parallel=sp)
    a, s, h = GPT_175B.heads, GPT_175B.seq_len, GPT_175B.hidden
    expected = s * b * h * per_sbh(a, s, h, tp)
    assert layer_activation_bytes(GPT_175B, A100, layout) == pytest.approx(expected)


def test_without_dropout_the_masks_and_the_dropped_out_scores_go():
    """Korthikanti et al. 2022, Sec. 4.1: of the 34·s·b·h, 2 are the two residual dropout
    masks (1 byte each); of the 5·a·s²·b, the softmax dropout's mask (a·s²·b) and its
    output (2·a·s²·b). Without dropout: 32·s·b·h + 2·a·s²·b."""
    layout = Layout(micro_batch=2, global_batch=2)
    a, s, h, b = GPT_175B.heads, GPT_175B.seq_len, GPT_175B.hidden, 2
    plain = replace(GPT_175B, dropout=False)
    assert layer_activation_bytes(plain, A100, layout) == pytest.approx(
        s * b * h * (32 + 2 * a * s / h))
    assert "dropout masks" not in {k for k, v in activation_terms(plain, A100, layout).items()
                                   if v}


def test_grouped_query_attention_keeps_smaller_keys_and_values():
    """Query, key and value are the inputs of Q·Kᵀ and of the value multiply: h values
    per token for Q, kv_heads · h/heads each for K and V, split over t."""
    layout = Layout(tp=8, micro_batch=1, global_batch=1)
    gqa = replace(GPT_175B, kv_heads=8)
    tokens, h = GPT_175B.seq_len, GPT_175B.hidden
    kv_width = 8 * h // GPT_175B.heads
    assert activation_terms(gqa, A100, layout)["query, key, value"] == pytest.approx(
        2 * tokens * (h + 2 * kv_width) / 8)
    assert activation_terms(GPT_175B, A100, layout)["query, key, value"] == pytest.approx(
        2 * tokens * 3 * h / 8)


def test_gated_mlp_keeps_both_halves_and_their_product():
    """A GeLU MLP keeps the GeLU's input and output (Korthikanti: 8 + 8 s·b·h at
    ffn = 4h); SwiGLU keeps its two projections' outputs and their product: 3·ffn."""
    layout = Layout(micro_batch=1, global_batch=1)
    tokens, f = GPT_175B.seq_len, 53248
    gelu = replace(GPT_175B, ffn_hidden=f)
    swiglu = replace(gelu, gated_mlp=True)
    assert activation_terms(gelu, A100, layout)["MLP inner"] == 2 * tokens * 2 * f
    assert activation_terms(swiglu, A100, layout)["MLP inner"] == 2 * tokens * 3 * f


def test_flash_attention_keeps_no_score_matrices():
    """Dao et al. 2022: the fused kernel keeps only one float32 log-sum-exp per head
    and token besides its inputs and output, so nothing grows with s²."""
    layout = Layout(tp=8, micro_batch=1, global_batch=1, flash_attention=True)
    terms = activation_terms(GPT_175B, A100, layout)
    assert "attention scores" not in terms
    assert terms["softmax statistics"] == 4 * GPT_175B.seq_len * GPT_175B.heads / 8
    longer = replace(GPT_175B, seq_len=2 * GPT_175B.seq_len)
    assert layer_activation_bytes(longer, A100, layout) == pytest.approx(
        2 * layer_activation_bytes(GPT_175B, A100, layout))


def test_mixed_precision_adam_holds_16_bytes_per_parameter():
    weights, gradients, optimizer = state_bytes(1e9, A100, Layout())
    assert (weights, gradients, optimizer) == (2e9, 2e9, 12e9)


def test_distributed_optimizer_shards_only_the_optimizer_states():
    layout = Layout(dp=8, global_batch=8, distributed_optimizer=True)
    assert state_bytes(1e9, A100, layout) == (2e9, 2e9, 12e9 / 8)


def test_sharded_gradients_shard_the_gradients_too():
    layout = Layout(dp=8, global_batch=8, distributed_optimizer=True, shard_gradients=True)
    assert state_bytes(1e9, A100, layout) == (2e9, 2e9 / 8, 12e9 / 8)


@pytest.mark.parametrize("run", RUNS, ids=lambda r: r.name)
def test_published_layouts_fit_their_gpus(run):
    """Every published run ran, so its busiest GPU must fit the GPU's memory."""
    cluster = CLUSTERS[run.cluster_name]
    assert predict(run.model, cluster, run.layout).memory <= cluster.hbm_bytes


def test_llama_in_flight_count_is_the_interleaved_warm_up():
    """Llama 3 405B at 8,192 GPUs: m = 32, p = 16, v = 8 chunks of one layer. Rank 1 runs
    (p − 2)·2 + (v − 1)·p forwards before its first backward (Megatron-LM's interleaved
    warm-up for rank r: (p − r − 1)·2 + (v − 1)·p), and holds one more at its peak;
    rank 0 less, its first chunk holding only the embedding."""
    run = BY_NAME["Llama 3 405B, 8192 GPUs"]
    plan = predict(run.model, H100, run.layout)
    per_layer = layer_activation_bytes(run.model, H100, run.layout)
    p, v = 16, 8
    assert plan.memory.activations == pytest.approx(((p - 2) * 2 + (v - 1) * p + 1)
                                                    * per_layer)
    assert plan.timeline.peak_activations(plan.costs.layers)[0] == 7 * 16


def test_busiest_gpu_memory_adds_up_and_counts_what_the_schedule_holds():
    layout = Layout(tp=8, pp=8, dp=1, micro_batch=1, global_batch=64, recompute="full")
    plan = predict(GPT_175B, A100, layout)
    m = plan.memory
    assert float(m) == pytest.approx(m.weights + m.gradients + m.optimizer + m.activations)
    assert m.optimizer == pytest.approx(6 * m.weights)
    # 1F1B holds p = 8 micro-batches on stage 0: more than GPipe's 1 stage, less than m
    gpipe = predict(GPT_175B, A100, replace(layout, schedule="gpipe"))
    assert gpipe.memory.activations > 4 * m.activations
    # 12 layers per stage (96 / 8) of 2·s·b·h bytes (full recompute) per micro-batch
    per_micro_batch = 12 * 2 * 2048 * 12288
    assert m.activations >= 8 * per_micro_batch


# -- bad input ------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, message", [
    (dict(schedule="1f1f"), "unknown schedule"),
    (dict(recompute="some"), "recompute must be one of"),
    (dict(dp=3, micro_batch=2, global_batch=8), "not a multiple of dp × micro_batch"),
    (dict(schedule="1f1b", virtual_stages=2), "needs a looped schedule"),
    (dict(schedule="zb_v", virtual_stages=3), "always puts 2 stages"),
    (dict(tp=0), "tp must be a positive integer"),
    (dict(sequence_parallel=True), "needs tp > 1"),
    (dict(dp=2, global_batch=2, shard_gradients=True), "needs distributed_optimizer"),
])
def test_invalid_layout_is_refused_with_what_to_change(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Layout(**kwargs)


@pytest.mark.parametrize("layout, message", [
    (Layout(tp=5, global_batch=1), "does not divide heads"),
    (Layout(pp=64, virtual_stages=2, schedule="interleaved_1f1b", global_batch=8),
     "cannot fill 128 model chunks"),
])
def test_layout_that_does_not_split_the_model_is_refused(layout, message):
    with pytest.raises(ValueError, match=message):
        predict(GPT_175B, A100, layout)


def test_gpus_that_do_not_match_the_layout_are_refused():
    with pytest.raises(ValueError, match=r"tp × pp × dp = 8 × 8 × 1 = 64 GPUs, not 128"):
        predict(GPT_175B, A100, Layout(tp=8, pp=8, global_batch=8), gpus=128)


def test_unknown_cluster_name_is_refused():
    with pytest.raises(ValueError, match="unknown cluster 'A100'"):
        predict(GPT_175B, "A100", Layout())


# -- search -----------------------------------------------------------------------------------

@pytest.mark.parametrize("run", [r for r in RUNS if r.cluster_name == "A100-80GB"],
                         ids=lambda r: r.name)
def test_search_finds_a_layout_at_least_as_fast_as_the_published_one(run):
    published = predict(run.model, A100, run.layout)
    result = search(run.model, A100, run.layout.gpus, run.layout.global_batch)
    best = result.best
    assert best.plan is not None and best.plan.fits
    assert best.step_time <= published.step_time * 1.0001
    assert best.layout.gpus == run.layout.gpus
    assert differences(best.layout, run.layout) != "same layout" \
        or best.step_time == pytest.approx(published.step_time)


def test_search_ranks_by_time_and_gives_every_rejection_a_reason():
    result = search(GPT_175B, A100, 64, 64)
    simulated = [c for c in result.ranked if c.plan is not None]
    times = [c.step_time for c in simulated]
    assert times == sorted(times) and len(simulated) == 4
    assert all(c.memory <= A100.hbm_bytes for c in result.ranked)
    reasons = {r.reason.split(" ")[0] for r in result.rejected}
    assert "needs" in reasons                               # too big for 80 GB
    assert any("does not divide heads" in r.reason for r in result.rejected)   # tp 64
    assert all(r.reason for r in result.rejected)


# -- small micro-batches: weight-sized traffic -------------------------------------------------

def test_weight_gradient_reads_the_gradient_it_accumulates_into():
    """On a machine whose multiplies are free, a block's weight-gradient pass is its four
    multiplies' bytes: the activations read, the k × n gradient written and the k × n
    sum over micro-batches read (Megatron-LM's and autograd's accumulation alike)."""
    from pipeline_lib.plan.costs import layer_pass
    free = replace(A100, peak_flops=1e30, kernel_overhead=0.0)
    model = Model(layers=2, hidden=64, heads=4, seq_len=8, vocab=100, ffn_hidden=256)
    layer, _ = layer_pass(model, free, Layout(micro_batch=2, global_batch=2))
    m, h, f, e = 16, 64, 256, 2
    shapes = [(m, h, 3 * h), (m, h, h), (m, h, f), (m, f, h)]
    bandwidth = free.hbm_bandwidth * free.bandwidth_efficiency
    assert layer.weight_grad == pytest.approx(
        sum(e * (a * k + 2 * k * n + a * n) for a, k, n in shapes) / bandwidth)
