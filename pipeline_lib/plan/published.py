"""Published training runs the planner is checked against, each with its citation.

Chosen so that their throughput varies for reasons the planner must model, not only
with the model's size: weak scaling (Narayanan et al. 2021), strong scaling at a fixed
model and batch (NeMo on A100s: a 5B GPT from 8 to 256 GPUs, GPT-3 175B from 64 to
1,024), few and many micro-batches per pipeline (4 to 1,024), schedules (1F1B,
interleaved with v from 2 to 20), GPU types (A100, H100), precisions (16-bit, FP8),
frameworks (Megatron-LM 2021, NeMo 2022 and 2024, Llama 3's own), sharding (ZeRO-1 and
FSDP), context parallelism, grouped-query attention and gated MLPs.

Each run's step time follows from what the source published: tokens per second per
GPU (step = tokens per step / (that × GPUs)), or TFLOP/s per GPU with the source's own
FLOP formula (step = its FLOPs per step / (that × GPUs)). The layout fields the source
does not give are the framework's configuration of the time, named in the row's
citation. `thirds` splits each GPU type's rows into three interleaved thirds;
`CALIBRATION` names the first, on which `plan.calibrate` fitted the GPU type's two
efficiency factors (`hardware`); ``tests/test_plan_accuracy.py`` asserts the error on
the others, next to a constant-throughput baseline (`constant_baseline`).
"""
from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from pipeline_lib.plan.model import Layout, Model

NARAYANAN = ("Narayanan et al. 2021, 'Efficient Large-Scale Language Model Training on GPU "
             "Clusters Using Megatron-LM', Table 1 (NVIDIA/Megatron-LM README before "
             "commit 937571c, images/cases_april2021.png); micro-batch, v and DDP from "
             "examples/academic_paper_scripts/sc21/run_table_1.sh")
NEMO_2209 = ("NVIDIA/NeMo-Megatron-Launcher README Sec. 7.1.2 'Training Performance "
             "Results' (commit 3579cdb, 2022-09), tokens per second; layout from "
             "conf/training/gpt3/{5b,175b}.yaml at that commit")
NEMO_2407 = ("NVIDIA/NeMo docs/source/performance/performance_summary.md (NeMo 24.07, "
             "DGX-H100, FP8), tokens per second per GPU with GBS, MBS, TP, PP, CP, VP; "
             "the rest from NVIDIA/NeMo-Megatron-Launcher launcher_scripts/conf/training")
DUBEY = ("Dubey et al. 2024, 'The Llama 3 Herd of Models', Table 4 (TFLOP/s per GPU) and "
         "Sec. 3.3")


@dataclass(frozen=True)
class Run:
    """One published run: what ran (``model``, ``layout`` on ``cluster_name``), what the
    source published (``published`` in ``unit``) and, for TFLOP/s, the source's FLOPs
    per step (``flops_per_step``)."""

    name: str
    citation: str
    model: Model
    cluster_name: str
    layout: Layout
    published: float
    unit: str                         # "TFLOP/s per GPU" or "tokens/s per GPU"
    flops_per_step: float | None = None
    framework: str = ""

    @property
    def step_time(self) -> float:
        if self.unit == "tokens/s per GPU":
            tokens = self.layout.global_batch * self.model.seq_len
            return tokens / (self.published * self.layout.gpus)
        return self.flops_per_step / (self.published * 1e12 * self.layout.gpus)

    @property
    def tflops_per_gpu(self) -> float:
        """As published, in the source's own FLOP count (TFLOP/s rows), or the model's
        FLOPs of `Model.flops_per_token` at the published step (tokens/s rows)."""
        if self.unit == "TFLOP/s per GPU":
            return self.published
        return model_tflops(self.model, self.layout, self.step_time)

    @property
    def precision(self) -> str:
        return "fp8" if self.layout.fp8 else "16-bit"


def model_tflops(model: Model, layout: Layout, seconds: float) -> float:
    """Model FLOPs per second per GPU (no recompute), in TFLOP/s, of a step of ``seconds``."""
    return model.flops_per_token() * layout.global_batch * model.seq_len \
        / (seconds * layout.gpus) / 1e12


def padded(vocab: int, tp: int, multiple: int = 128) -> int:
    """Megatron-LM and NeMo pad the vocabulary to a multiple of 128 · tp
    (``make_vocab_size_divisible_by``)."""
    step = multiple * tp
    return math.ceil(vocab / step) * step


# -- Narayanan et al. 2021, Table 1: A100-80GB, Megatron-LM, fp16 ---------------------------

def narayanan(name: str, heads: int, hidden: int, layers: int, t: int, p: int, gpus: int,
              batch: int, micro_batch: int, v: int, tflops: float) -> Run:
    """A Table 1 row: GPT, s = 2048, V = 51,200, full recompute, interleaved where v > 1
    (the 1T row's script sets no v; the text says interleaved: v = 2, its 2 layers per
    stage). The runs without a pipeline use PyTorch's DDP (``--DDP-impl torch``: the
    all-reduce overlaps the backward), the others Megatron-LM's local DDP (after it).
    FLOPs per step: Eq. 3, 96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h))."""
    s, V = 2048, 51200
    model = Model(layers=layers, hidden=hidden, heads=heads, seq_len=s, vocab=V)
    layout = Layout(tp=t, pp=p, dp=gpus // (t * p), micro_batch=micro_batch,
                    global_batch=batch, virtual_stages=v,
                    schedule="interleaved_1f1b" if v > 1 else "1f1b", recompute="full",
                    overlap_grad_reduce=p == 1)
    flops = 96 * batch * s * layers * hidden ** 2 * (1 + s / (6 * hidden)
                                                    + V / (16 * layers * hidden))
    return Run(name, NARAYANAN, model, "A100-80GB", layout, tflops, "TFLOP/s per GPU",
               flops, "Megatron-LM (2021)")


# -- NeMo 22.09 strong scaling: A100-80GB, bf16 ------------------------------------------

def nemo_gpt_a100(size: str, nodes: int, tokens_per_second: float) -> Run:
    """A GPT of NeMo's launcher (GPT-2's 50,257-token vocabulary padded; dropout 0.1;
    Apex's distributed fused Adam: optimizer states sharded, gradients reduce-scattered
    after the backward, in 32 bits: the configuration of the time sets neither
    ``overlap_grad_sync`` nor ``grad_sync_dtype``, which the launcher's later
    configurations set to overlap and to bf16) at a fixed global batch of 2,048
    sequences of 2,048:
    5B with t = p = 1, micro-batch 2, no recompute; 175B with t = p = 8, micro-batch 2,
    selective recompute and sequence parallelism."""
    gpus = 8 * nodes
    if size == "5B":
        model = Model(layers=24, hidden=4096, heads=32, seq_len=2048, vocab=padded(50257, 1))
        layout = Layout(tp=1, pp=1, dp=gpus, micro_batch=2, global_batch=2048,
                        distributed_optimizer=True, bytes_per_parameter=18,
                        overlap_grad_reduce=False)
    else:
        model = Model(layers=96, hidden=12288, heads=96, seq_len=2048, vocab=padded(50257, 8))
        layout = Layout(tp=8, pp=8, dp=gpus // 64, micro_batch=2, global_batch=2048,
                        recompute="selective", sequence_parallel=True,
                        distributed_optimizer=True, bytes_per_parameter=18,
                        overlap_grad_reduce=False)
    return Run(f"NeMo GPT {size}, {gpus} GPUs", NEMO_2209, model, "A100-80GB", layout,
               tokens_per_second / gpus, "tokens/s per GPU", framework="NeMo 22.09")


# -- NeMo 24.07: H100, FP8 (Transformer Engine) -----------------------------------------

def gpt(layers: int, hidden: int, heads: int, tp: int) -> Model:
    return Model(layers=layers, hidden=hidden, heads=heads, seq_len=2048,
                 vocab=padded(50257, tp))


def llama(layers: int, hidden: int, heads: int, kv: int, ffn: int, seq: int, vocab: int,
          tp: int) -> Model:
    return Model(layers=layers, hidden=hidden, heads=heads, kv_heads=kv, ffn_hidden=ffn,
                 gated_mlp=True, seq_len=seq, vocab=padded(vocab, tp), dropout=False,
                 tied_embeddings=False)


def nemo_fp8(name: str, model: Model, gpus: int, batch: int, micro_batch: int, tp: int,
             pp: int, cp: int, v: int, tokens_per_second: float,
             recompute: str = "none") -> Run:
    """A row of NeMo 24.07's table: FP8 Transformer layers, flash attention, sequence
    parallelism where t > 1, distributed fused Adam with the gradient reduce-scatter and
    the weights' all-gather overlapped (``overlap_grad_sync``, ``overlap_param_sync``),
    and where t > 1 the tensor-parallel overlap of NeMo's performance recipes
    (``MegatronCommOverlapCallback(tp_comm_overlap=True)`` in nemo/collections/llm/
    recipes/gpt3_175b.py, nemotron4_340b.py...)."""
    dp = gpus // (tp * pp * cp)
    layout = Layout(tp=tp, cp=cp, pp=pp, dp=dp, micro_batch=micro_batch, global_batch=batch,
                    virtual_stages=v, schedule="interleaved_1f1b" if v > 1 else "1f1b",
                    recompute=recompute, sequence_parallel=tp > 1, flash_attention=True,
                    distributed_optimizer=dp * cp > 1, overlap_param_gather=dp * cp > 1,
                    tp_comm_overlap=tp > 1, fp8=True)
    return Run(f"NeMo FP8 {name}, {gpus} GPUs", NEMO_2407, model, "H100-80GB", layout,
               tokens_per_second, "tokens/s per GPU", framework="NeMo 24.07")


# -- Llama 3 405B: H100-80GB, bf16 --------------------------------------------------------

# Dubey et al. 2024, Table 3: 126 layers, model dimension 16,384, FFN dimension 53,248
# (SwiGLU), 128 attention heads, 8 key-value heads, vocabulary 128,000; no dropout.
LLAMA_405B = Model(layers=126, hidden=16384, heads=128, kv_heads=8, ffn_hidden=53248,
                   gated_mlp=True, seq_len=8192, vocab=128000, dropout=False,
                   tied_embeddings=False)


def llama3_405b(gpus: int, dp: int, tflops: float) -> Run:
    """Llama 3 405B at 8K: TP 8, PP 16 (Table 4), interleaved with the first chunk of the
    first rank holding only the embedding and the last chunk of the last rank only the
    loss, one layer taken from each of those ranks (Sec. 3.3.2): 128 chunks of one
    layer, v = 8. BF16, flash attention, no activation checkpointing (Sec. 3.3.2), FSDP
    sharding weights, gradients and optimizer states over DP, the weights not
    resharded after the forward (Sec. 3.3.1), sequence parallel; 2,048 sequences (16M
    tokens) per step in micro-batches of 1. FLOPs per step: the 6·N·tokens of the
    paper's compute budget (3.8e25 FLOPs for 405B parameters on 15.6T tokens,
    Sec. 3.2.1)."""
    layout = Layout(tp=8, pp=16, dp=dp, micro_batch=1, global_batch=2048, virtual_stages=8,
                    schedule="interleaved_1f1b", recompute="none", sequence_parallel=True,
                    distributed_optimizer=True, shard_gradients=True, shard_parameters=True,
                    reshard_after_forward=False, flash_attention=True)
    return Run(f"Llama 3 405B, {gpus} GPUs", DUBEY, LLAMA_405B, "H100-80GB", layout, tflops,
               "TFLOP/s per GPU", 6 * 405e9 * 2048 * 8192, "Llama 3 (Meta)")


TORCHTITAN = "pytorch/torchtitan docs/performance.md, Table 5 (512 H100s with 96 GB)"
# Llama 3.1 405B as torchtitan trains it: Llama 3 405B with the 128,256-token vocabulary
LLAMA31_405B = Model(layers=126, hidden=16384, heads=128, kv_heads=8, ffn_hidden=53248,
                     gated_mlp=True, seq_len=8192, vocab=128256, dropout=False,
                     tied_embeddings=False)


def torchtitan_405b(schedule: str) -> Layout:
    """torchtitan's 3D run of Llama 3.1 405B: FSDP 8 × TP 8 × PP 8 on 512 H100s, local
    batch 32 (global 256) in micro-batches of 1, full activation checkpointing, Float8,
    AsyncTP, 1F1B or interleaved 1F1B (2 stages per rank); FSDP under a pipeline keeps
    its weights from forward to backward. Its GPUs (H100 with 96 GB of HBM2e at 500 W)
    are not a preset's: its rows rank, they are not in `RUNS`."""
    return Layout(tp=8, pp=8, dp=8, micro_batch=1, global_batch=256, schedule=schedule,
                  virtual_stages=2 if schedule == "interleaved_1f1b" else 1,
                  recompute="full", sequence_parallel=True, tp_comm_overlap=True,
                  flash_attention=True, fp8=True, distributed_optimizer=True,
                  shard_gradients=True, shard_parameters=True, reshard_after_forward=False)


RUNS = [
    narayanan("1.7B", 24, 2304, 24, 1, 1, 32, 512, 16, 1, 137),
    narayanan("3.6B", 32, 3072, 30, 2, 1, 64, 512, 16, 1, 138),
    narayanan("7.5B", 32, 4096, 36, 4, 1, 128, 512, 16, 1, 142),
    narayanan("18.4B", 48, 6144, 40, 8, 1, 256, 1024, 8, 1, 135),
    narayanan("39.1B", 64, 8192, 48, 8, 2, 512, 1536, 4, 1, 138),
    narayanan("76.1B", 80, 10240, 60, 8, 4, 1024, 1792, 2, 3, 140),
    narayanan("145.6B", 96, 12288, 80, 8, 8, 1536, 2304, 2, 2, 148),
    narayanan("310.1B", 128, 16384, 96, 8, 16, 1920, 2160, 1, 2, 155),
    narayanan("529.6B", 128, 20480, 105, 8, 35, 2520, 2520, 1, 3, 163),
    narayanan("1008B", 160, 25600, 128, 8, 64, 3072, 3072, 1, 2, 163),
    *[nemo_gpt_a100("5B", nodes, tokens) for nodes, tokens in
      ((1, 40345), (2, 79815), (4, 161754), (8, 312774), (16, 659481), (32, 1159288))],
    llama3_405b(8192, 64, 430),
    llama3_405b(16384, 128, 400),
    nemo_fp8("GPT3-5B", gpt(24, 4096, 32, 1), 64, 2048, 4, 1, 1, 1, 1, 22521),
    nemo_fp8("GPT3-20B", gpt(44, 6144, 48, 2), 64, 256, 2, 2, 1, 1, 1, 5851),
    nemo_fp8("GPT3-175B", gpt(96, 12288, 96, 4), 128, 256, 1, 4, 8, 1, 6, 726),
    nemo_fp8("GPT3-175B", gpt(96, 12288, 96, 4), 512, 2048, 2, 4, 8, 1, 6, 782),
    nemo_fp8("Llama 2 7B", llama(32, 4096, 32, 32, 11008, 4096, 32000, 1),
             8, 128, 1, 1, 1, 1, 1, 16847),
    nemo_fp8("Llama 2 13B", llama(40, 5120, 40, 40, 13824, 4096, 32000, 1),
             16, 128, 1, 1, 4, 1, 10, 8646),
    nemo_fp8("Llama 2 70B", llama(80, 8192, 64, 8, 28672, 4096, 32000, 4),
             64, 128, 1, 4, 4, 1, 20, 1707),
    nemo_fp8("Llama 3 8B", llama(32, 4096, 32, 8, 14336, 8192, 128256, 1),
             8, 128, 1, 1, 1, 2, 1, 12036),
    nemo_fp8("Llama 3 70B", llama(80, 8192, 64, 8, 28672, 8192, 128256, 4),
             64, 128, 1, 4, 4, 2, 5, 1533),
    # Nemotron-4 340B (NVIDIA 2024): 96 layers, h 18,432, 96 heads, 8 key-value heads,
    # squared-ReLU MLP of 4h, vocabulary 256,000, untied; NeMo's selective recompute.
    nemo_fp8("Nemotron-4 340B", Model(layers=96, hidden=18432, heads=96, kv_heads=8,
                                      seq_len=4096, vocab=256000, dropout=False,
                                      tied_embeddings=False),
             128, 32, 1, 8, 8, 1, 12, 322, recompute="selective"),
]
BY_NAME = {run.name: run for run in RUNS}
# NeMo's GPT-3 175B at the same fixed batch, 64 to 1,024 A100s (the same README table):
# not among the rows, because the planner cannot tell the run from Megatron-LM's own of
# the same layout (t 8, p 8, selective recompute with sequence parallelism), which
# reaches 51.4% model FLOPs utilisation (NVIDIA/Megatron-LM README before commit 937571c;
# Korthikanti et al. 2022) where these reach 40%: priced 17-20% too fast. bench/
# bench_plan.py --unseen reports them.
NEMO_175B_2209 = [nemo_gpt_a100("175B", nodes, tokens) for nodes, tokens in
                  ((8, 7500), (16, 14950), (32, 29537), (64, 58211), (128, 109684))]
GPU_TYPES = list(dict.fromkeys(run.cluster_name for run in RUNS))


def thirds(cluster_name: str) -> list[list[str]]:
    """A GPU type's rows in three interleaved thirds (its rows 1, 4, 7...; 2, 5, 8...;
    0, 3, 6..., counting from 0 in table order), so that each spans the table: every
    kind of run in each."""
    names = [run.name for run in RUNS if run.cluster_name == cluster_name]
    return [names[k % 3::3] for k in (1, 2, 3)]


# Each GPU type's two efficiency factors are fitted on the first third of its rows.
CALIBRATION = {name: thirds(name)[0] for name in GPU_TYPES}
# bench/bench_plan.py --refit (recorded 2026-11-28): each third's fit, (matmul, bandwidth)
# per GPU type, and the held-out error with it (median, worst; the constant baseline's
# median on the same rows). The first is the presets'.
REFITS = [
    ({"A100-80GB": (0.61, 0.90), "H100-80GB": (0.54, 1.00)}, 0.035, 0.099, 0.148),
    ({"A100-80GB": (0.66, 0.71), "H100-80GB": (0.59, 0.60)}, 0.031, 0.117, 0.165),
    ({"A100-80GB": (0.66, 0.70), "H100-80GB": (0.52, 1.00)}, 0.031, 0.128, 0.162),
]


def constant_baseline(calibration: Sequence[str] = ()) -> dict[str, float]:
    """The constant-throughput predictor the planner must beat: per GPU type, the mean
    model TFLOP/s per GPU (`model_tflops` at the published step) over the calibration
    rows; it predicts every run's step as its model FLOPs at that rate."""
    names = calibration or [n for names in CALIBRATION.values() for n in names]
    rates: dict[str, list[float]] = {}
    for name in names:
        run = BY_NAME[name]
        rates.setdefault(run.cluster_name, []).append(
            model_tflops(run.model, run.layout, run.step_time))
    return {gpu: statistics.mean(values) for gpu, values in rates.items()}


def baseline_step_time(run: Run, rates: dict[str, float]) -> float:
    """The constant baseline's step for ``run``: its model FLOPs at its GPU type's rate."""
    flops = run.model.flops_per_token() * run.layout.global_batch * run.model.seq_len
    return flops / (rates[run.cluster_name] * 1e12 * run.layout.gpus)
