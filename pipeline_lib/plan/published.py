"""Published training runs the planner is checked against, each with its citation.

Each run's step time is derived from its published throughput with the paper's own FLOP
formula (`Run.step_time`). `CALIBRATION` names the rows (a third of them) on which
`plan.calibrate` fitted each GPU type's two efficiency factors; ``tests/test_plan.py``
asserts the error on the others, and notebook 07 prints the whole table.
"""
from __future__ import annotations

from dataclasses import dataclass

from pipeline_lib.plan.model import Layout, Model

NARAYANAN = ("Narayanan et al. 2021, 'Efficient Large-Scale Language Model Training on GPU "
             "Clusters Using Megatron-LM', Table 1; micro-batch and v from "
             "NVIDIA/Megatron-LM examples/academic_paper_scripts/sc21/run_table_1.sh")
DUBEY = "Dubey et al. 2024, 'The Llama 3 Herd of Models', Table 4 and Sec. 3.3.1"


@dataclass(frozen=True)
class Run:
    name: str
    citation: str
    model: Model
    cluster_name: str
    layout: Layout
    tflops_per_gpu: float       # as published
    flops_per_step: float       # the paper's own formula

    @property
    def step_time(self) -> float:
        return self.flops_per_step / (self.tflops_per_gpu * 1e12 * self.layout.gpus)


def narayanan(name: str, heads: int, hidden: int, layers: int, t: int, p: int, gpus: int,
              batch: int, micro_batch: int, v: int, tflops: float) -> Run:
    """A Table 1 row: GPT, s = 2048, V = 51,200, full recompute, interleaved where v > 1
    (the 1T row's script sets no v; the text says interleaved: v = 2, its 2 layers per
    stage). FLOPs per step: Eq. 3, 96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h))."""
    s, V = 2048, 51200
    model = Model(layers=layers, hidden=hidden, heads=heads, seq_len=s, vocab=V)
    layout = Layout(tp=t, pp=p, dp=gpus // (t * p), micro_batch=micro_batch,
                    global_batch=batch, virtual_stages=v,
                    schedule="interleaved_1f1b" if v > 1 else "1f1b", recompute="full")
    flops = 96 * batch * s * layers * hidden ** 2 * (1 + s / (6 * hidden)
                                                    + V / (16 * layers * hidden))
    return Run(name, NARAYANAN, model, "A100-80GB", layout, tflops, flops)


# Dubey et al. 2024, Table 3: 126 layers, model dimension 16,384, FFN dimension 53,248
# (SwiGLU), 128 attention heads, 8 key-value heads, vocabulary 128,000; no dropout.
LLAMA_405B = Model(layers=126, hidden=16384, heads=128, kv_heads=8, ffn_hidden=53248,
                   gated_mlp=True, seq_len=8192, vocab=128000, dropout=False)


def llama(gpus: int, dp: int, tflops: float) -> Run:
    """Llama 3 405B at 8K: TP 8, PP 16 (Table 4), interleaved with the first chunk of the
    first rank holding only the embedding and the last chunk of the last rank only the
    loss, one layer taken from each of those ranks (Sec. 3.3.2): 128 chunks of one
    layer, v = 8. BF16, flash attention, no activation checkpointing (Sec. 3.3.2),
    FSDP sharding the optimizer states and gradients over DP (Sec. 3.3.1), sequence
    parallel; 2,048 sequences (16M tokens) per step in micro-batches of 1. FLOPs per
    step: the 6·N·tokens of the paper's compute budget (3.8e25 FLOPs for 405B
    parameters on 15.6T tokens, Sec. 3.2.1)."""
    layout = Layout(tp=8, pp=16, dp=dp, micro_batch=1, global_batch=2048, virtual_stages=8,
                    schedule="interleaved_1f1b", recompute="none", sequence_parallel=True,
                    distributed_optimizer=True, shard_gradients=True, flash_attention=True)
    return Run(f"Llama 3 405B, {gpus} GPUs", DUBEY, LLAMA_405B, "H100-80GB", layout, tflops,
               6 * 405e9 * 2048 * 8192)


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
    llama(8192, 64, 430),
    llama(16384, 128, 400),
]
BY_NAME = {run.name: run for run in RUNS}
# A100: both factors on three rows spanning h = 2304 to 12288; H100: its matmul factor
# on the 8,192-GPU run (one run fixes one factor).
CALIBRATION = {"A100-80GB": ["1.7B", "18.4B", "145.6B"],
               "H100-80GB": ["Llama 3 405B, 8192 GPUs"]}
