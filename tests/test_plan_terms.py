"""What real runs overlap and shard, term by term, each against its closed form.

Tensor-parallel communication overlapped with the multiplies (Megatron-LM's
``--tp-comm-overlap``), the data-parallel reduction per bucket behind the backwards that
remain, the distributed optimizer's all-gather, ZeRO stages 1-3 and FSDP, context
parallelism's ring, the framework's per-action overhead, FP8 multiplies.
"""
from __future__ import annotations

from dataclasses import replace

import pytest

from pipeline_lib.plan import CLUSTERS, Layout, Model, predict
from pipeline_lib.plan.costs import (attention_core, block_gemms, chunk_costs, layer_pass,
                                     ring_seconds, tensor_parallel_collectives)
from pipeline_lib.plan.hardware import GiB
from pipeline_lib.plan.memory import activation_terms, chunk_parameters
from pipeline_lib.plan.predict import data_parallel_bandwidth

A100, H100 = CLUSTERS["A100-80GB"], CLUSTERS["H100-80GB"]
GPT = Model(layers=8, hidden=4096, heads=32, seq_len=2048, vocab=51200)


def slow(cluster, factor: float):
    """``cluster`` with every link ``factor`` times slower (HBM and compute unchanged)."""
    return replace(cluster, intra_node_bandwidth=cluster.intra_node_bandwidth / factor,
                   inter_node_bandwidth=cluster.inter_node_bandwidth / factor)


# -- tensor parallelism -------------------------------------------------------------------

@pytest.mark.parametrize("factor", [1, 50])
def test_tensor_parallel_overlap_hides_each_collective_behind_its_multiply(factor):
    """Forward: four collectives of b·s·h values, each (t − 1)/t of them per GPU; in line
    they add 4·c, pipelined with the multiply next to each they add Σ max(g_i, c) − g_i
    (Megatron-LM's --tp-comm-overlap; Wang et al. 2023): less than in line, and on a
    slow link 4·c − Σ g_i."""
    cluster = slow(H100, factor)
    layout = Layout(tp=4, micro_batch=1, global_batch=1, sequence_parallel=True)
    tokens = 2048
    gemms = block_gemms(GPT, cluster, tokens, 4)
    one = ring_seconds(2 * tokens * 4096, 4, cluster.link_bandwidth(False), cluster.latency, 1.0)
    inline = tensor_parallel_collectives(GPT, cluster, layout, gemms, gemms, gemms)
    hidden = tensor_parallel_collectives(GPT, cluster, replace(layout, tp_comm_overlap=True),
                                         gemms, gemms, gemms)
    assert inline.forward == pytest.approx(4 * one)
    assert hidden.forward == pytest.approx(sum(max(g, one) - g for g in gemms))
    assert hidden.forward < inline.forward
    if factor > 1:
        assert hidden.forward == pytest.approx(4 * one - sum(gemms))
    full = layer_pass(GPT, cluster, layout)[0]
    overlapped = layer_pass(GPT, cluster, replace(layout, tp_comm_overlap=True))[0]
    assert overlapped.forward == pytest.approx(full.forward - inline.forward + hidden.forward)


# -- data parallelism ---------------------------------------------------------------------

def dp_layout(**kwargs) -> Layout:
    return Layout(pp=1, dp=4, micro_batch=1, global_batch=16, **kwargs)


def test_gradient_reduction_runs_bucket_by_bucket_behind_the_last_backward():
    """One chunk of n layers whose last backward takes B: each layer's bucket (a ring of
    its gradients, r) starts as the backward produces it. If r <= B/n only the last
    bucket is exposed; on a slow link, n·r − (n − 1)/n · B. Without overlap, all n·r."""
    for factor in (1, 200):
        cluster = slow(A100, factor)
        plan = predict(GPT, cluster, dp_layout())
        params = chunk_parameters(GPT, dp_layout(), [8])[0]
        bucket = ring_seconds(2 * params / 8, 4, data_parallel_bandwidth(cluster, dp_layout()),
                              cluster.latency)
        ring = 8 * bucket
        last = max((e for e in plan.timeline.events if e.action.kind == "B"),
                   key=lambda e: e.end)
        backward = last.end - last.start
        expected = bucket if bucket <= backward / 8 else ring - 7 / 8 * backward
        assert plan.data_parallel_time == pytest.approx(expected, rel=1e-6)
        late = predict(GPT, cluster, dp_layout(overlap_grad_reduce=False))
        assert late.data_parallel_time == pytest.approx(ring, rel=1e-6)


def test_distributed_optimizer_reduce_scatters_then_gathers_the_weights():
    """ZeRO-1 (Megatron-LM's distributed optimizer): a reduce-scatter (half an
    all-reduce's bytes) and, after the optimizer, an all-gather of the updated 16-bit
    weights, exposed; with overlap_param_gather each layer's is gathered before its
    first forward of the next step, so only what runs ahead of the forwards shows."""
    cluster = slow(A100, 200)
    layout = dp_layout(distributed_optimizer=True, overlap_grad_reduce=False)
    params = chunk_parameters(GPT, layout, [8])[0]
    bandwidth = data_parallel_bandwidth(cluster, layout)
    gather = ring_seconds(2 * params / 8, 4, bandwidth, cluster.latency, 1.0)   # a layer's
    scatter = 8 * gather
    plan = predict(GPT, cluster, layout)
    assert plan.data_parallel_time == pytest.approx(2 * scatter, rel=1e-6)
    overlapped = predict(GPT, cluster, replace(layout, overlap_param_gather=True))
    first = min((e for e in overlapped.timeline.events if e.action.kind == "F"),
                key=lambda e: e.start)
    forward = first.end - first.start
    expected = scatter + max(k * gather - (k - 1) / 8 * forward for k in range(1, 9))
    assert overlapped.data_parallel_time == pytest.approx(expected, rel=1e-6)


def test_sharded_gradients_reduce_scatter_every_micro_batch():
    """ZeRO-2: a replica keeps only its slice, so each of the m backwards reduce-scatters
    its gradients (as a stream of their own): m times ZeRO-1's reduce-scatter bytes. On a
    link so slow that the stream runs far behind, it ends about m reduce-scatters after
    the first backward."""
    cluster = slow(A100, 2000)
    zero1 = predict(GPT, cluster, dp_layout(distributed_optimizer=True))
    zero2 = predict(GPT, cluster, dp_layout(distributed_optimizer=True, shard_gradients=True))
    params = chunk_parameters(GPT, dp_layout(), [8])[0]
    scatter = 8 * ring_seconds(2 * params / 8, 4, data_parallel_bandwidth(cluster, dp_layout()),
                               cluster.latency, 1.0)
    m = dp_layout().microbatches
    assert zero2.data_parallel_time > zero1.data_parallel_time
    first_backward = min(e.start for e in zero2.timeline.events if e.action.kind == "B")
    tail = first_backward + m * scatter - zero2.pipeline_time
    gather = zero2.data_parallel_time - tail                       # the all-gather after
    assert gather == pytest.approx(scatter, rel=0.02)


def test_zero_3_gathers_before_every_forward_and_backward():
    """ZeRO-3 resharding after the forward (FSDP's default): each forward first gathers
    the chunk's weights, each backward gathers them again and reduce-scatters the
    gradients, all on the data-parallel link; an action takes the longer of its compute
    and that traffic. Keeping the weights from forward to backward (Llama 3) gathers
    once per step."""
    cluster = slow(A100, 2000)
    zero3 = dp_layout(distributed_optimizer=True, shard_gradients=True, shard_parameters=True)
    plan = predict(GPT, cluster, zero3)
    params = chunk_parameters(GPT, zero3, [8])[0]
    ring = ring_seconds(2 * params, 4, data_parallel_bandwidth(cluster, zero3),
                        cluster.latency, 1.0)
    compute = chunk_costs(GPT, cluster, zero3)
    assert plan.costs.forward[0] == pytest.approx(max(compute.forward[0], ring))
    assert plan.costs.backward[0] == pytest.approx(max(compute.backward[0], 2 * ring))
    keep = predict(GPT, cluster, replace(zero3, reshard_after_forward=False))
    assert keep.costs.forward == compute.forward
    assert keep.step_time < plan.step_time


# -- context parallelism -----------------------------------------------------------------

@pytest.mark.parametrize("factor", [1, 500])
def test_ring_attention_passes_keys_and_values_under_the_attention(factor):
    """Context parallelism (ring attention; Liu et al. 2023): each of cp GPUs computes
    the attention of its s/cp queries, and in each of cp − 1 steps passes a chunk of
    keys and values (2·kv·(s/cp)·e per micro-batch) while the previous one's attention
    computes: a step takes the longer of the two; the backward passes their gradients
    too. Everything else runs on s/cp tokens."""
    cluster = slow(H100, factor)
    one = Layout(tp=1, micro_batch=1, global_batch=1, flash_attention=True)
    four = replace(one, cp=4)
    whole = attention_core(GPT, cluster, one)
    split = attention_core(GPT, cluster, four)
    send = 2 * 2 * (2048 / 4) * 4096 / cluster.link_bandwidth(False) + cluster.latency
    step_f, step_b = whole.forward / 4 / 4, whole.input_grad / 4 / 4    # s/cp queries
    assert split.forward == pytest.approx(whole.forward / 4 + 3 * (max(step_f, send) - step_f))
    assert split.input_grad == pytest.approx(
        whole.input_grad / 4 + 3 * (max(step_b, 2 * send) - step_b))
    gemms_one = sum(block_gemms(GPT, cluster, 2048, 1))
    gemms_four = sum(block_gemms(GPT, cluster, 512, 1))
    assert gemms_four == pytest.approx(gemms_one / 4, rel=0.02)


def test_context_parallelism_divides_activations_and_counts_its_gpus():
    layout = Layout(tp=2, cp=4, pp=2, dp=3, micro_batch=1, global_batch=6,
                    sequence_parallel=True)
    assert layout.gpus == 2 * 4 * 2 * 3 and layout.replicas == 12
    single = replace(layout, cp=1)
    for name, value in activation_terms(GPT, H100, layout).items():
        assert value == pytest.approx(activation_terms(GPT, H100, single)[name] / 4), name


# -- the framework, and FP8 -------------------------------------------------------------------

def test_per_action_overhead_adds_to_every_forward_and_backward():
    """`Cluster.action_overhead`: what the framework spends per micro-batch and stage
    besides the kernels (measured on this machine by `plan.local`; 0 on the GPU presets,
    whose kernels are queued ahead). Without a pipeline, m forwards and m backwards
    each take it once more: 2·m·o."""
    layout = Layout(micro_batch=1, global_batch=16)
    base = predict(GPT, A100, layout).pipeline_time
    slower = predict(GPT, replace(A100, action_overhead=1e-3), layout).pipeline_time
    assert slower - base == pytest.approx(2 * 16 * 1e-3)


def test_fp8_multiplies_run_at_the_presets_fp8_rate():
    """An FP8 multiply (Transformer Engine) is priced at the cluster's fp8_flops: on the
    H100 preset 989 TFLOP/s × 1.2 / 0.74 (FlashAttention-3: the same kernels reach 1.2
    PFLOP/s in FP8 and 740 TFLOP/s in 16 bits), not the datasheet's 2×; its inputs
    are read as 1-byte values."""
    free = replace(H100, hbm_bandwidth=1e30)                  # compute-bound
    sixteen = sum(block_gemms(GPT, free, 4096, 1))
    eight = sum(block_gemms(GPT, free, 4096, 1, fp8=True))
    assert H100.fp8_flops == pytest.approx(989e12 * 1.2 / 0.74)
    assert sixteen / eight == pytest.approx(H100.fp8_flops / H100.peak_flops)
    fp8 = Layout(micro_batch=2, global_batch=2, fp8=True, flash_attention=True)
    assert predict(GPT, H100, fp8).step_time < predict(GPT, H100, replace(fp8, fp8=False)).step_time


def test_fp8_keeps_the_multiplies_inputs_in_one_byte():
    """Transformer Engine saves each multiply's input as it read it, in FP8: the norms'
    outputs and the attention output take 1 byte per value, the MLP's activation output
    too; the rest stays 16-bit."""
    layout = Layout(micro_batch=1, global_batch=1, flash_attention=True)
    bf16, fp8 = (activation_terms(GPT, H100, replace(layout, fp8=f)) for f in (False, True))
    assert fp8["norm outputs"] == bf16["norm outputs"] / 2
    assert fp8["attention output"] == bf16["attention output"] / 2
    assert fp8["MLP inner"] == pytest.approx(bf16["MLP inner"] * 3 / 4)
    assert fp8["query, key, value"] == bf16["query, key, value"]


def test_thirty_two_bit_gradients_double_the_reduced_bytes():
    """Megatron-LM's 18-byte convention reduces its 32-bit gradients: twice the bytes of
    16-bit ones, here on a link slow enough that the whole ring shows."""
    cluster = slow(A100, 200)
    sixteen = predict(GPT, cluster, dp_layout(overlap_grad_reduce=False)).data_parallel_time
    eighteen = predict(GPT, cluster, dp_layout(overlap_grad_reduce=False,
                                               bytes_per_parameter=18)).data_parallel_time
    assert eighteen == pytest.approx(2 * sixteen, rel=1e-3)


def test_first_and_last_stages_with_fewer_layers():
    """Megatron-LM's --decoder-first/last-pipeline-num-layers: the ends fixed, the rest
    shared evenly; Llama 3's 126 layers on 128 chunks leave the ends with none."""
    from pipeline_lib.plan.model import layers_per_chunk
    assert layers_per_chunk(32, 4, 7, 7) == [7, 9, 9, 7]
    assert layers_per_chunk(126, 128) == [0] + [1] * 126 + [0]
    assert layers_per_chunk(96, 16) == [6] * 16
    plan = predict(GPT, A100, Layout(pp=4, global_batch=8, first_stage_layers=1,
                                     last_stage_layers=1))
    assert plan.costs.layers == [1, 3, 3, 1]
    assert plan.memory < 80 * GiB
