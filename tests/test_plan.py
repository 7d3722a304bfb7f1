"""pipeline_lib.plan's core: the simulated step, the activation formulas, the model
states, bad input. Accuracy against published runs is tests/test_plan_accuracy.py, the
published rankings tests/test_plan_rankings.py, what real runs overlap and shard
tests/test_plan_terms.py, memory that says "fits" tests/test_plan_memory.py, the search
tests/test_plan_search.py."""
from __future__ import annotations

from dataclasses import replace

import pytest

from pipeline_lib.plan import CLUSTERS, Layout, Model, predict
from pipeline_lib.plan.costs import ring_seconds
from pipeline_lib.plan.published import BY_NAME
from pipeline_lib.plan.memory import activation_terms, layer_activation_bytes, state_bytes
from pipeline_lib.plan.predict import chunk_parameters
from pipeline_lib.timeline import Timeline

A100, H100 = CLUSTERS["A100-80GB"], CLUSTERS["H100-80GB"]


def test_fraction_of_peak_grows_with_hidden_size():
    """Table 1's 44% at h = 2304 and 52% at h = 25600 come from the elementwise work
    that the roofline prices, though the largest runs have the biggest bubble."""
    small = predict(BY_NAME["1.7B"].model, A100, BY_NAME["1.7B"].layout)
    large = predict(BY_NAME["1008B"].model, A100, BY_NAME["1008B"].layout)
    assert large.bubble_fraction > small.bubble_fraction
    assert large.tflops_per_gpu > 1.05 * small.tflops_per_gpu
    for plan, run in ((small, BY_NAME["1.7B"]), (large, BY_NAME["1008B"])):
        assert plan.tflops_per_gpu == pytest.approx(run.tflops_per_gpu, rel=0.1)


GPT_175B = Model(layers=96, hidden=12288, heads=96, seq_len=2048, vocab=51200)


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
    (8, False, "full", lambda a, s, h, t: 2),
    (8, True, "full", lambda a, s, h, t: 2 / t),
])
def test_activations_per_layer_are_korthikanti_table_2(tp, sp, recompute, per_sbh):
    """Korthikanti et al. 2022, 'Reducing Activation Recomputation in Large Transformer
    Models', Table 2: bytes per layer as s·b·h times the listed factor. Full recompute
    keeps each layer's input, 2·s·b·h, which sequence parallelism splits over t (the
    input is sequence-split: Megatron-LM checkpoints it so)."""
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


def test_mixed_precision_adam_holds_16_or_18_bytes_per_parameter():
    """ZeRO's count (Rajbhandari et al. 2020, Sec. 3.1): 2 + 2 + 12; Megatron-LM's, with
    32-bit gradients (theoretical_memory_usage.py): 2 + 4 + 12."""
    assert state_bytes(1e9, A100, Layout()) == (2e9, 2e9, 12e9)
    assert state_bytes(1e9, A100, Layout(bytes_per_parameter=18)) == (2e9, 4e9, 12e9)


def test_distributed_optimizer_shards_only_the_optimizer_states():
    layout = Layout(dp=8, global_batch=8, distributed_optimizer=True)
    assert state_bytes(1e9, A100, layout) == (2e9, 2e9, 12e9 / 8)


def test_sharded_gradients_shard_the_gradients_too():
    layout = Layout(dp=8, global_batch=8, distributed_optimizer=True, shard_gradients=True)
    assert state_bytes(1e9, A100, layout) == (2e9, 2e9 / 8, 12e9 / 8)


def test_zero_3_shards_the_weights_over_data_and_context_replicas():
    """ZeRO stage 3 / FSDP: everything over the dp · cp GPUs holding the same weights."""
    layout = Layout(dp=4, cp=2, global_batch=8, distributed_optimizer=True,
                    shard_gradients=True, shard_parameters=True)
    assert layout.zero_stage == 3 and layout.replicas == 8
    assert state_bytes(1e9, A100, layout) == (2e9 / 8, 2e9 / 8, 12e9 / 8)


def test_busiest_gpu_memory_adds_up_and_counts_what_the_schedule_holds():
    layout = Layout(tp=8, pp=8, dp=1, micro_batch=1, global_batch=64, recompute="full")
    plan = predict(GPT_175B, A100, layout)
    m = plan.memory
    assert float(m) == pytest.approx(m.weights + m.gradients + m.optimizer + m.activations
                                     + m.reserved)
    assert m.reserved == A100.reserved_bytes
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
    (dict(dp=2, global_batch=2, distributed_optimizer=True, shard_parameters=True),
     "set shard_gradients=True"),
    (dict(reshard_after_forward=False), "needs shard_parameters=True"),
    (dict(overlap_param_gather=True), "needs distributed_optimizer=True"),
    (dict(tp=2, tp_comm_overlap=True), "needs sequence_parallel=True"),
    (dict(bytes_per_parameter=17), "is 16 .ZeRO's count"),
    (dict(cp=0), "cp must be a positive integer"),
    (dict(first_stage_layers=-1), "first_stage_layers must be None"),
])
def test_invalid_layout_is_refused_with_what_to_change(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Layout(**kwargs)


@pytest.mark.parametrize("layout, message", [
    (Layout(tp=5, global_batch=1), "does not divide heads"),
    (Layout(pp=64, virtual_stages=2, schedule="interleaved_1f1b", global_batch=8),
     "cannot fill 128 model chunks"),
    (Layout(tp=8, global_batch=1, sequence_parallel=True, cp=3),
     "does not divide seq_len 2048"),
    (Layout(pp=4, global_batch=4, first_stage_layers=90, last_stage_layers=10),
     "do not leave the other stages"),
])
def test_layout_that_does_not_split_the_model_is_refused(layout, message):
    with pytest.raises(ValueError, match=message):
        predict(GPT_175B, A100, layout)


def test_gpus_that_do_not_match_the_layout_are_refused():
    with pytest.raises(ValueError,
                       match=r"tp × cp × pp × dp = 8 × 1 × 8 × 1 = 64 GPUs, not 128"):
        predict(GPT_175B, A100, Layout(tp=8, pp=8, global_batch=8), gpus=128)


def test_fp8_on_a_gpu_without_fp8_tensor_cores_is_refused():
    with pytest.raises(ValueError, match="fp8=True needs FP8 tensor cores"):
        predict(GPT_175B, A100, Layout(fp8=True))


def test_unknown_cluster_name_is_refused():
    with pytest.raises(ValueError, match="unknown cluster 'A100'"):
        predict(GPT_175B, "A100", Layout())


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
