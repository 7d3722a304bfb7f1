"""Published comparisons the planner must order as published, each with its citation.

A planner is used to choose between layouts, so ranking is what it must not get wrong.
Each row of `RANKINGS` names two layouts of one run, what was compared (step time, or
memory), which one the source found better, and where it says so; the planner must
agree, by more than a rounding (`MARGIN`).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import pytest

from pipeline_lib.plan import CLUSTERS, Layout, Model, predict
from pipeline_lib.plan.published import BY_NAME, LLAMA31_405B, torchtitan_405b

A100, H100 = CLUSTERS["A100-80GB"], CLUSTERS["H100-80GB"]
MARGIN = 0.01          # the better one must be better by more than 1%

GPT3 = Model(layers=96, hidden=12288, heads=96, seq_len=2048, vocab=51200)
# Narayanan et al. 2021, Fig. 13: a 162.2B GPT (examples/academic_paper_scripts/sc21/
# run_figure_13.sh in NVIDIA/Megatron-LM: 32 layers, h 20480, 128 heads, micro-batch 1,
# full recompute, 64 GPUs as (t, p) = (2, 32) ... (32, 2))
GPT162 = Model(layers=32, hidden=20480, heads=128, seq_len=2048, vocab=51200)
# Korthikanti et al. 2022's 530B GPT (Narayanan et al.'s 529.6B row)
GPT530 = Model(layers=105, hidden=20480, heads=128, seq_len=2048, vocab=51200)
# Megatron-LM README (H100 scaling): GPT-3 with a 131,072-token vocabulary, sequence 4096
GPT3_H100 = Model(layers=96, hidden=12288, heads=96, seq_len=4096, vocab=131072,
                  tied_embeddings=False)

NARAYANAN = ("Narayanan et al. 2021, Sec. 5.3.1 and Fig. 12 (NVIDIA/Megatron-LM "
             "examples/academic_paper_scripts/sc21/run_figure_12.sh: t 8, p 12, "
             "micro-batch 1, 2 layers per virtual stage)")


def fig12(batch: int, interleaved: bool) -> Layout:
    return Layout(tp=8, pp=12, micro_batch=1, global_batch=batch, recompute="full",
                  schedule="interleaved_1f1b" if interleaved else "1f1b",
                  virtual_stages=4 if interleaved else 1)


def fig13(t: int, batch: int) -> Layout:
    return Layout(tp=t, pp=64 // t, micro_batch=1, global_batch=batch, recompute="full")


def korthikanti(recompute: str) -> Layout:
    """The 530B GPT on 2,240 A100s (t 8, p 35, d 8, v 3 as Narayanan et al.'s row; the
    batch, not in the abstract, 2,240)."""
    return Layout(tp=8, pp=35, dp=8, micro_batch=1, global_batch=2240, virtual_stages=3,
                  schedule="interleaved_1f1b", recompute=recompute,
                  sequence_parallel=recompute == "selective")


def strong(gpus: int) -> Layout:
    """Megatron-LM's H100 strong scaling of GPT-3 at a fixed batch of 1,152. Its layouts
    are not published: t 8, p 8, v 6 here, the data dimension growing with the GPUs."""
    return Layout(tp=8, pp=8, dp=gpus // 64, micro_batch=1, global_batch=1152,
                  schedule="interleaved_1f1b", virtual_stages=6, sequence_parallel=True,
                  tp_comm_overlap=True, flash_attention=True, distributed_optimizer=True,
                  overlap_param_gather=True)


@dataclass(frozen=True)
class Ranking:
    name: str
    citation: str
    model: Model
    cluster: object
    better: Layout
    worse: Layout
    measure: str = "time"             # "time": step time; "memory": busiest GPU
    per_gpu: bool = False             # time: compare the GPUs' throughput, not the step


RANKINGS = [
    Ranking("interleaved beats 1F1B at a small batch (12)", NARAYANAN, GPT3, A100,
            fig12(12, True), fig12(12, False)),
    Ranking("interleaved still ahead at a large batch (60), by less", NARAYANAN, GPT3, A100,
            fig12(60, True), fig12(60, False)),
    *[Ranking(f"tp 8 beats tp {t} on 64 GPUs, batch {b}",
              "Narayanan et al. 2021, Sec. 5.4.1 and Fig. 13", GPT162, A100,
              fig13(8, b), fig13(t, b)) for b in (32, 128) for t in (2, 4, 16, 32)],
    Ranking("ZB-H1 beats 1F1B at the same memory",
            "Qi et al. 2024 (ICLR), 'Zero Bubble Pipeline Parallelism', abstract and "
            "Sec. 2.1: up to 23% over 1F1B under a similar memory limit", GPT3, A100,
            replace(fig12(48, False), schedule="zb_h1"), fig12(48, False)),
    Ranking("ZB-V beats 1F1B at 1F1B's memory",
            "Qi et al. 2024, arXiv 2401.10241 (ZB-V), and sail-sg/zero-bubble-pipeline-"
            "parallelism README: bubble 0, activation memory 1x of 1F1B's", GPT3, A100,
            replace(fig12(48, False), schedule="zb_v"), fig12(48, False)),
    Ranking("selective recompute with sequence parallelism beats full recompute",
            "Korthikanti et al. 2022, abstract: 530B on 2,240 A100s, 54.2% against "
            "42.1% model FLOPs utilisation", GPT530, A100, korthikanti("selective"),
            korthikanti("full")),
    Ranking("interleaved beats 1F1B at 512 H100s (405B)",
            "torchtitan docs/performance.md, Table 5: 128 against 100 tokens/s per GPU",
            LLAMA31_405B, H100, torchtitan_405b("interleaved_1f1b"),
            torchtitan_405b("1f1b")),
    Ranking("more GPUs at a fixed batch: a shorter step",
            "NVIDIA/NeMo-Megatron-Launcher README Sec. 7.1.2: GPT 5B from 1 to 32 DGX "
            "A100 nodes, 28.7x the tokens per second on 32x the GPUs",
            BY_NAME["NeMo GPT 5B, 256 GPUs"].model, A100,
            BY_NAME["NeMo GPT 5B, 256 GPUs"].layout, BY_NAME["NeMo GPT 5B, 8 GPUs"].layout),
    Ranking("more GPUs at a fixed batch: less per GPU",
            "NVIDIA/Megatron-LM README, strong scaling: GPT-3 from 96 to 4,608 H100s at "
            "a batch of 1,152, model FLOPs utilisation from 47% to 42%", GPT3_H100, H100,
            strong(128), strong(4608), per_gpu=True),
    Ranking("more virtual stages hold fewer activations (v 10 against 5)",
            "NVIDIA-NeMo/Megatron-Bridge PR #3107: Llama 3 70B on 32 H100s, TP 4, PP 4, "
            "DP 2, FP8: VPP 5 (4 layers per chunk) ran out of memory, VPP 10 (2 per chunk) "
            "fit. Megatron-LM's interleaved warm-up, (v − 1)·g + 2(p − 1 − r) + 1 chunks "
            "of l/(p·v) layers, shrinks as v grows",
            BY_NAME["NeMo FP8 Llama 3 70B, 64 GPUs"].model, H100,
            replace(BY_NAME["NeMo FP8 Llama 3 70B, 64 GPUs"].layout, cp=1, virtual_stages=10),
            replace(BY_NAME["NeMo FP8 Llama 3 70B, 64 GPUs"].layout, cp=1, virtual_stages=5),
            measure="memory"),
]


def measure(ranking: Ranking, layout: Layout) -> float:
    plan = predict(ranking.model, ranking.cluster, layout)
    if ranking.measure == "memory":
        return plan.memory
    return plan.step_time * layout.gpus if ranking.per_gpu else plan.step_time


@pytest.mark.parametrize("ranking", RANKINGS, ids=lambda r: r.name)
def test_planner_orders_as_published(ranking):
    better, worse = measure(ranking, ranking.better), measure(ranking, ranking.worse)
    assert better < (1 - MARGIN) * worse, (ranking.citation, better, worse)


def test_interleaving_gains_less_as_the_batch_grows():
    """Narayanan et al. 2021, Fig. 12: interleaving's lead over 1F1B closes as the batch,
    and with it the micro-batches per pipeline, grows (the bubble it shortens is (p − 1)
    of m + p − 1 stage steps)."""
    def gain(batch: int) -> float:
        return predict(GPT3, A100, fig12(batch, False)).step_time \
            / predict(GPT3, A100, fig12(batch, True)).step_time

    gains = [gain(b) for b in (12, 24, 36, 48, 60)]
    assert all(a > b for a, b in zip(gains, gains[1:])), gains


def test_zero_bubble_schedules_keep_1f1bs_memory():
    """Qi et al.: ZB-H1 holds 1F1B's peak activations; ZB-V the same (2p chunks of half
    a stage); within a few per cent here, the V's last chunk also holding the loss."""
    base = predict(GPT3, A100, fig12(48, False)).memory
    for schedule in ("zb_h1", "zb_v"):
        memory = predict(GPT3, A100, replace(fig12(48, False), schedule=schedule)).memory
        assert memory == pytest.approx(base, rel=0.05), schedule


def test_selective_recompute_fits_where_published():
    """Korthikanti et al.: both recompute settings of the 530B run fit an A100's 80 GiB."""
    for recompute in ("full", "selective"):
        assert predict(GPT530, A100, korthikanti(recompute)).fits, recompute



@pytest.mark.xfail(strict=True, reason=(
    "torchtitan's Table 5 measures 72.7 GiB interleaved against 82.5 GiB for 1F1B; the "
    "planner counts what the schedules keep in flight (more chunks for the interleaved "
    "warm-up, as Megatron-LM's theoretical_memory_usage.py does: 1 + (p - 1)/(p v)) and "
    "not what the framework's allocator and FSDP buffers hold per stage module, which "
    "the measured difference must come from. A known miss, reported in bench/README."))
def test_interleaved_needs_less_memory_than_1f1b_at_512_h100s():
    """torchtitan docs/performance.md, Table 5 (Llama 3.1 405B on 512 H100s)."""
    interleaved = predict(LLAMA31_405B, H100, torchtitan_405b("interleaved_1f1b")).memory
    assert interleaved < predict(LLAMA31_405B, H100, torchtitan_405b("1f1b")).memory
