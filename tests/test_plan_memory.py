"""Memory you can trust to say "fits": Megatron-LM's formula reproduced term by term
where the conventions agree, what the schedule holds counted from its own order, the
allowance for what a process holds besides its tensors, and published runs that fit."""
from __future__ import annotations

import random
from dataclasses import replace

import pytest

from pipeline_lib.plan import CLUSTERS, Layout, Model, predict
from pipeline_lib.plan.hardware import GiB
from pipeline_lib.plan.memory import (chunk_parameters, embedding_activation_bytes,
                                      held_peaks,
                                      layer_activation_bytes, logits_bytes, schedule_peaks,
                                      state_bytes)
from pipeline_lib.plan.model import layers_per_chunk
from pipeline_lib.plan.predict import layout_memory
from pipeline_lib.plan.published import LLAMA31_405B, RUNS, torchtitan_405b
from pipeline_lib.plan.search import search_memory
from pipeline_lib.schedules import build
from pipeline_lib.timeline import simulate

A100, H100 = CLUSTERS["A100-80GB"], CLUSTERS["H100-80GB"]
GPT = Model(layers=96, hidden=12288, heads=96, seq_len=2048, vocab=51200)


# -- Megatron-LM's megatron/training/theoretical_memory_usage.py, term by term ------------

def megatron_weight_and_optimizer_bytes(model: Model, layout: Layout) -> float:
    """The file's compute_weight_and_optimizer_memory for a GPT (LayerNorm, biases
    counted with the matrices as the planner counts them, tied embedding): the most
    loaded shard holds l/p layers and the embedding, split over t except the norms,
    at 18 bytes per parameter, or 6 + 12/d with the distributed optimizer."""
    h, l, p, t, d = model.hidden, model.layers, layout.pp, layout.tp, layout.dp
    norms = 2 * 2 * h                        # two LayerNorms of weight and bias
    matrices = model.layer_parameters() - norms
    shard = (matrices * l / p + model.vocab * h) / t + norms * l / p
    per_parameter = 6 + 12 / d if layout.distributed_optimizer else 18
    return shard * per_parameter


@pytest.mark.parametrize("distributed", [False, True])
def test_weights_and_optimizer_are_megatrons_18_bytes_or_6_plus_12_over_d(distributed):
    """Megatron-LM's convention (fp32 gradients, bytes_per_parameter=18): its formula and
    the planner's states on the first stage agree but for the norms, which Megatron-LM
    replicates over t and the planner splits (0.02% here)."""
    layout = Layout(tp=8, pp=8, dp=16, global_batch=128, bytes_per_parameter=18,
                    distributed_optimizer=distributed)
    layers = layers_per_chunk(GPT.layers, layout.chunks)
    ours = sum(state_bytes(chunk_parameters(GPT, layout, layers)[0], A100, layout))
    assert ours == pytest.approx(megatron_weight_and_optimizer_bytes(GPT, layout), rel=3e-4)


def test_activations_per_layer_are_megatrons_18_plus_4_ffn_over_h():
    """The file's compute_activation_memory, per layer: s·b·h·(18 + 4·ffn/h) / t, with
    sequence parallelism and selective recompute (Korthikanti et al.'s 34·s·b·h/t at
    ffn = 4h), for any ffn."""
    for ffn in (4 * 4096, 3 * 4096, 10880):
        model = Model(layers=8, hidden=4096, heads=32, seq_len=4096, vocab=51200,
                      ffn_hidden=ffn)
        layout = Layout(tp=8, micro_batch=2, global_batch=2, sequence_parallel=True,
                        recompute="selective")
        s, b, h = 4096, 2, 4096
        assert layer_activation_bytes(model, A100, layout) == pytest.approx(
            s * b * h * (18 + 4 * ffn / h) / 8)


def test_embedding_and_output_terms_agree_where_the_conventions_do():
    """The file adds, per micro-batch in flight on the first stage, the embedding
    dropout's mask (s·b·h bytes, split over t with sequence parallelism: the planner
    too) and the token ids (8·s·b, which the file also divides by t while every
    tensor-parallel GPU holds them whole: the planner keeps 8·s·b); and with p = 1 the
    4·s·b·V/t bytes of the float32 logits the cross-entropy keeps (the planner too;
    the file's 4·s·b·h of the output layer's input it counts with the last layer)."""
    layout = Layout(tp=8, micro_batch=2, global_batch=2, sequence_parallel=True)
    s, b, h, V = 2048, 2, 12288, 51200
    assert embedding_activation_bytes(GPT, layout) == pytest.approx(8 * s * b + s * b * h / 8)
    assert logits_bytes(GPT, layout) == pytest.approx(4 * s * b * V / 8)


def test_interleaved_in_flight_is_megatrons_where_m_is_a_multiple_of_p():
    """The file multiplies the l layers' activations by 1 + (p − 1)/(p·v): p·v + p − 1
    chunks of l/(p·v) layers in flight on rank 0, which is Megatron-LM's interleaved
    warm-up, (v − 1)·p + 2(p − 1) + 1, when the micro-batches go in rounds of p (Megatron-
    LM requires m to be a multiple of p). The planner counts what its schedule holds:
    the same there, and, where m is not a multiple of p (PyTorch's rounds: one of all m
    if m < 2p), more."""
    for p, v, m in ((16, 8, 32), (4, 5, 64), (8, 2, 24)):
        sizes = [1.0] * (p * v)
        ours = schedule_peaks("interleaved_1f1b", p, m, v, sizes, [0])[0]
        assert ours == p * v * (1 + (p - 1) / (p * v)) == p * v + p - 1
        assert ours == held_peaks(build("interleaved_1f1b", p, m, v), sizes)[0]
    p, v, m = 8, 2, 12
    assert schedule_peaks("interleaved_1f1b", p, m, v, [1.0] * 16, [0])[0] > p * v + p - 1


# -- what a schedule holds, from its order ------------------------------------------------

CASES = [("1f1b", 4, 3, 1), ("1f1b", 8, 32, 1), ("gpipe", 4, 6, 1), ("zb_h1", 6, 12, 1),
         ("zb_h2", 4, 9, 1), ("interleaved_1f1b", 4, 8, 2), ("interleaved_1f1b", 4, 13, 3),
         ("interleaved_1f1b", 8, 5, 2), ("interleaved_zero_bubble", 4, 8, 2),
         ("looped_bfs", 3, 5, 2), ("zb_v", 4, 8, 2), ("dualpipe_v", 4, 8, 2)]


@pytest.mark.parametrize("name, p, m, v", CASES)
def test_in_flight_counts_from_the_order_agree_with_the_built_schedule(name, p, m, v):
    """`schedule_peaks` computes each rank's peak from prefix sums of its forwards and
    backwards, without building the schedule; the built schedule walked action by
    action and its simulated timeline must hold the same, whatever the chunks' sizes."""
    rng = random.Random(f"{name}{p}{m}{v}")
    schedule = build(name, p, m, v)
    sizes = [rng.randint(0, 5) + rng.random() for _ in range(schedule.stages)]
    fast = schedule_peaks(name, p, m, v, sizes)
    walked = held_peaks(schedule, sizes)
    timed = simulate(schedule, [rng.random() + 0.1 for _ in sizes],
                     [rng.random() + 0.2 for _ in sizes]).peak_activations(sizes)
    assert fast == pytest.approx(walked) and walked == pytest.approx(timed)


def test_search_counts_memory_as_predict_does():
    """`search` prices every layout's memory with the ranks that can hold the most only
    (0, 1, p − 1); on every published layout it is `predict`'s, to the byte."""
    for run in RUNS:
        cluster = CLUSTERS[run.cluster_name]
        layers = layers_per_chunk(run.model.layers, run.layout.chunks)
        assert float(search_memory(run.model, cluster, run.layout, layers)) == \
            pytest.approx(float(layout_memory(run.model, cluster, run.layout)), rel=1e-12)


# -- the allowance, and published runs that fit ------------------------------------------

def test_every_gpu_holds_the_allowance_for_context_and_buffers():
    """The presets' reserved_bytes (1 GiB: the CUDA context and cuBLAS's workspace, NCCL's
    buffers) count on every GPU, part of the total that must fit."""
    plan = predict(GPT, A100, Layout(tp=8, pp=16, dp=8, global_batch=1536, recompute="full"))
    assert plan.memory.reserved == GiB == A100.reserved_bytes == H100.reserved_bytes
    bare = predict(GPT, replace(A100, reserved_bytes=0.0), plan.layout).memory
    assert plan.memory - bare == pytest.approx(GiB)


@pytest.mark.parametrize("run", RUNS, ids=lambda r: r.name)
def test_published_layouts_fit_their_gpus(run):
    """Every published run ran, so its busiest GPU, allowance included, fits; Llama 3
    405B without activation recompute at 8K (Dubey et al. 2024, Sec. 3.3.2) among them."""
    cluster = CLUSTERS[run.cluster_name]
    assert predict(run.model, cluster, run.layout).fits


def test_torchtitans_405b_run_fits_its_gpus():
    """torchtitan docs/performance.md, Table 5: Llama 3.1 405B on 512 H100s with 96 GB
    (FSDP 8, TP 8, PP 8, full activation checkpointing) ran at 82.5 GiB. Full recompute
    keeps each layer's input split over t under sequence parallelism (2·s·b·h/t): the
    planner fits it where one that kept 2·s·b·h per layer said 144 GiB (issue 37)."""
    h100_96 = replace(H100, name="H100-96GB", hbm_bytes=96 * 1000 ** 3)
    plan = predict(LLAMA31_405B, h100_96, torchtitan_405b("1f1b"))
    assert plan.fits
    unsplit = layer_activation_bytes(LLAMA31_405B, H100, replace(plan.layout,
                                                                  sequence_parallel=False,
                                                                  tp_comm_overlap=False))
    assert unsplit == pytest.approx(8 * layer_activation_bytes(LLAMA31_405B, H100,
                                                               plan.layout))


def test_what_does_not_fit_is_said_so():
    """GPT-3 175B's 2.8 TB of model states (16 bytes per parameter) on 8 GPUs with
    tensor parallelism alone: 350 GB each, far beyond 80 GiB."""
    plan = predict(GPT, A100, Layout(tp=8, global_batch=8))
    assert not plan.fits
    assert plan.memory.weights + plan.memory.gradients + plan.memory.optimizer == \
        pytest.approx(16 * GPT.parameters() / 8, rel=0.01)
