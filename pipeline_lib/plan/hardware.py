"""Clusters: the hardware numbers a plan is priced with.

Each preset holds spec-sheet numbers (peak dense 16-bit FLOP/s, HBM size and bandwidth,
NVLink and network bandwidth per GPU) and exactly two efficiency factors, the same for
every run on that GPU type: the fraction of peak that large matrix multiplies reach, and
the fraction of a link's (or HBM's) nominal bandwidth that a transfer reaches. Nothing
is fitted to one run: a planner that is tuned per row predicts only its table.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from pipeline_lib.plan.model import Work


@dataclass(frozen=True)
class Cluster:
    """A homogeneous GPU cluster. Bandwidths are bytes/s per GPU, one direction.

    ``value_bytes`` is the size of one activation or weight value as trained (2 for
    16-bit mixed precision, 4 for float32 on a CPU); ``peak_flops`` is the peak for that
    precision. ``latency`` is the start-up time of one message (seconds).
    ``kernel_overhead`` is what a kernel costs however small it is (seconds): on a CPU
    running eager PyTorch, the dispatch and autograd bookkeeping of each operation, which
    is most of a small model's step; 0 on the GPU presets, whose kernels are queued ahead
    and start as the previous one ends. ``backward_overhead`` is the same for an
    operation of a backward, which autograd's engine dispatches from C++ with no Python
    frame or module call around it (None: as ``kernel_overhead``). ``action_overhead`` is
    what a pipeline executor spends per action besides its kernels (on a CPU its
    Python: cutting the graph at the stage boundary, the micro-batch's random stream);
    0 on the GPU presets, hidden behind the kernels queued ahead.
    ``send_overhead`` is what sending one stage-to-stage message costs the sender's own
    processor (LogP's o, Culler et al. 1993): on a CPU, gloo's sends run on the rank's
    core, in line with its compute; 0 on the GPU presets, whose messages NCCL moves on a
    stream of its own.
    ``receive_overhead`` is what a message costs its receiver's processor (LogP's o at
    the other end): on a CPU, handling it and resuming after the wait, when the rank's
    thread may come back on another core, its caches cold, or (threads of one process)
    find the GIL held; 0 on the GPU presets.
    ``fp8_flops``: the dense FP8 matrix-multiply FLOP/s of the spec sheet (None where
    the GPU has no FP8 tensor cores), which `Layout(fp8=True)` runs its Transformer
    layers' multiplies at. ``reserved_bytes``: what a training process holds besides
    the model's tensors (the CUDA context and kernels, cuBLAS workspaces, NCCL's
    buffers, the caching allocator's unused blocks), added to every GPU's memory.
    """

    name: str
    peak_flops: float            # dense matrix-multiply FLOP/s of one GPU
    hbm_bytes: float             # memory of one GPU
    hbm_bandwidth: float         # bytes/s
    gpus_per_node: int
    intra_node_bandwidth: float  # bytes/s per GPU, one direction (NVLink)
    inter_node_bandwidth: float  # bytes/s per GPU, one direction (InfiniBand / RoCE)
    matmul_efficiency: float     # achieved fraction of peak_flops on large GEMMs
    bandwidth_efficiency: float  # achieved fraction of every nominal bandwidth
    latency: float = 10e-6       # seconds per message
    value_bytes: int = 2
    kernel_overhead: float = 0.0
    backward_overhead: float | None = None
    action_overhead: float = 0.0
    send_overhead: float = 0.0
    receive_overhead: float = 0.0
    fp8_flops: float | None = None
    reserved_bytes: float = 0.0

    def __post_init__(self) -> None:
        for name in ("peak_flops", "hbm_bytes", "hbm_bandwidth", "intra_node_bandwidth",
                     "inter_node_bandwidth"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"Cluster {self.name!r}: {name} must be a positive number, "
                                 f"got {value!r}")
        for name in ("matmul_efficiency", "bandwidth_efficiency"):
            value = getattr(self, name)
            if not 0 < value <= 1:
                raise ValueError(f"Cluster {self.name!r}: {name} is a fraction of the "
                                 f"spec-sheet number, in (0, 1]; got {value!r}")
        if self.fp8_flops is not None and not (isinstance(self.fp8_flops, (int, float))
                                               and math.isfinite(self.fp8_flops)
                                               and self.fp8_flops > 0):
            raise ValueError(f"Cluster {self.name!r}: fp8_flops must be None or a positive "
                             f"number, got {self.fp8_flops!r}")
        if not (isinstance(self.reserved_bytes, (int, float)) and 0 <= self.reserved_bytes
                < self.hbm_bytes):
            raise ValueError(f"Cluster {self.name!r}: reserved_bytes must be >= 0 and less "
                             f"than hbm_bytes, got {self.reserved_bytes!r}")
        if self.gpus_per_node < 1 or self.value_bytes not in (2, 4) or self.latency < 0 \
                or min(self.kernel_overhead, self.backward_overhead or 0.0,
                       self.action_overhead, self.send_overhead, self.receive_overhead) < 0:
            raise ValueError(f"Cluster {self.name!r}: need gpus_per_node >= 1, value_bytes "
                             f"2 or 4, and latency and the kernel, backward, action, send "
                             f"and receive overheads >= 0")

    def gemm_seconds(self, flops: float, nbytes: float, fp8: bool = False) -> float:
        """A roofline: a kernel takes the longer of its compute and its memory traffic
        (in FP8, at ``fp8_flops``)."""
        peak = self.fp8_flops if fp8 else self.peak_flops
        if peak is None:
            raise ValueError(f"Cluster {self.name!r} has no fp8_flops: FP8 matrix "
                             f"multiplies need a GPU with FP8 tensor cores (H100, H800)")
        return max(flops / (peak * self.matmul_efficiency),
                   nbytes / (self.hbm_bandwidth * self.bandwidth_efficiency)) \
            + self.kernel_overhead

    def memory_seconds(self, nbytes: float, kernels: int = 1) -> float:
        """Memory-bound kernels (norm, softmax, dropout, optimizer): bytes over HBM."""
        return nbytes / (self.hbm_bandwidth * self.bandwidth_efficiency) \
            + kernels * self.kernel_overhead

    def work_seconds(self, work: Work, backward: bool = False) -> float:
        """Counted kernels (`Work`, of a ``backward`` or a forward): each operation's
        fixed cost, the matrix multiplies' FLOPs, and every byte read or written. Their
        sum, not a roofline's maximum: the rates are what one more token adds
        (`plan.measure.marginal_rate`), so the bytes a multiply streams whatever its size
        (its weights) are not hidden behind them."""
        per_op = self.backward_overhead if backward and self.backward_overhead is not None \
            else self.kernel_overhead
        return work.ops * per_op \
            + work.flops / (self.peak_flops * self.matmul_efficiency) \
            + (work.gemm_bytes + work.nbytes) / (self.hbm_bandwidth * self.bandwidth_efficiency)

    def link_bandwidth(self, inter_node: bool) -> float:
        nominal = self.inter_node_bandwidth if inter_node else self.intra_node_bandwidth
        return nominal * self.bandwidth_efficiency


GB, GiB, MiB = 1e9, 2 ** 30, 2 ** 20
# "80 GB" of HBM is 80 GiB (five 16 GiB stacks); what a program can allocate is what
# nvidia-smi reports as memory.total: 81,920 MiB on an A100 80GB, 81,559 MiB on an
# H100 80GB HBM3 (85.9 and 85.5 GB).
A100_HBM, H100_HBM = 81920 * MiB, 81559 * MiB

# Efficiency factors: the achieved fraction of peak FLOP/s on matrix multiplies and of
# nominal bandwidth on HBM and links, over a whole training step (launch gaps, loss
# scaling, gradient-norm kernels and other unmodelled work included). Each GPU type's
# two are fitted by `pipeline_lib.plan.calibrate` on the first third of its published
# rows (`plan.published.CALIBRATION`: A100 on Megatron-LM's 2021 and NeMo's 2022 runs,
# H100 on Llama 3's and NeMo's FP8 runs); tests/test_plan_accuracy.py checks that these
# are the fit's result, bench/bench_plan.py --refit how far they move on the other
# thirds. The bandwidth factor is the less determined of the two: on H100s it ends at
# its bound of 1 on two thirds of three, transfers and memory-bound kernels as fast as
# the spec sheet allows.
A100_MATMUL, A100_BANDWIDTH = 0.61, 0.90
H100_MATMUL, H100_BANDWIDTH = 0.54, 1.0
# FP8 on an H100: the datasheet's 1,979 TFLOP/s dense is twice the 16-bit peak, but the
# same kernels reach 1.2 PFLOP/s in FP8 where they reach 740 TFLOP/s in 16 bits
# (FlashAttention-3, Shah et al. 2024, abstract): in practice FP8 multiplies run 1.62
# times as fast as 16-bit ones, so the preset's FP8 rate is 1.62 × 989 TFLOP/s, reached
# at the same matmul efficiency as the 16-bit multiplies.
H100_FP8 = 989e12 * 1.2e15 / 740e12
# What a training process holds on each GPU besides its tensors, at least: the CUDA
# context with its kernels and cuBLAS's workspace (PyTorch's "CUDA semantics" notes: the
# context takes several hundred MiB that memory_allocated() does not show) and NCCL's
# buffers (NCCL_BUFFSIZE, 4 MiB per channel and peer by default: NCCL's environment
# variables documentation), 1 GiB in all. The caching allocator's unused blocks come on
# top and depend on the run; published runs that fit within a GiB of the memory (Llama
# 3 405B at 8K, NeMo's 5B GPT) bound what can be added here.
GPU_RESERVED = GiB

CLUSTERS: dict[str, Cluster] = {
    # NVIDIA A100 datasheet (SXM4 80GB): 312 TFLOP/s BF16/FP16 dense, 80 GB HBM2e at
    # 2,039 GB/s, NVLink 3 600 GB/s (300 per direction); DGX A100 / Selene: 8 GPUs per
    # node, 8 x 200 Gb/s HDR InfiniBand (25 GB/s per GPU).
    "A100-80GB": Cluster("A100-80GB", 312e12, A100_HBM, 2039 * GB, 8, 300 * GB, 25 * GB,
                         A100_MATMUL, A100_BANDWIDTH, reserved_bytes=GPU_RESERVED),
    # NVIDIA H100 datasheet (SXM5): 989 TFLOP/s BF16 dense, 80 GB HBM3 at 3.35 TB/s,
    # NVLink 4 900 GB/s (450 per direction); DGX H100: 8 x 400 Gb/s NDR (50 GB/s per GPU).
    "H100-80GB": Cluster("H100-80GB", 989e12, H100_HBM, 3350 * GB, 8, 450 * GB, 50 * GB,
                         H100_MATMUL, H100_BANDWIDTH, fp8_flops=H100_FP8,
                         reserved_bytes=GPU_RESERVED),
    # H800 SXM: the H100 die (same peak and HBM3) with NVLink cut to 400 GB/s (200 per
    # direction) for export; DeepSeek-V3 report Sec. 3.1: 8 x 400 Gb/s InfiniBand per node.
    "H800": Cluster("H800", 989e12, H100_HBM, 3350 * GB, 8, 200 * GB, 50 * GB,
                    H100_MATMUL, H100_BANDWIDTH, fp8_flops=H100_FP8,
                    reserved_bytes=GPU_RESERVED),
}
