"""Bytes on one GPU: weights, gradients, optimizer states and activations."""
from __future__ import annotations

from pipeline_lib.plan.hardware import Cluster
from pipeline_lib.plan.model import Layout, Model


class Memory(float):
    """Bytes on the busiest GPU (a float, so it compares and prints as one), with the
    breakdown as attributes: ``weights``, ``gradients``, ``optimizer`` (states) and
    ``activations`` (what the schedule keeps in flight, plus one layer's working set)."""

    weights: float
    gradients: float
    optimizer: float
    activations: float

    def __new__(cls, weights: float, gradients: float, optimizer: float,
                activations: float) -> "Memory":
        self = super().__new__(cls, weights + gradients + optimizer + activations)
        self.weights, self.gradients = weights, gradients
        self.optimizer, self.activations = optimizer, activations
        return self

    @property
    def total(self) -> float:
        return float(self)

    def __repr__(self) -> str:
        gb = lambda x: f"{x / 1e9:.1f} GB"
        return (f"Memory({gb(self)}: weights {gb(self.weights)}, gradients "
                f"{gb(self.gradients)}, optimizer {gb(self.optimizer)}, activations "
                f"{gb(self.activations)})")


def state_bytes(parameters: float, cluster: Cluster, layout: Layout) -> tuple[float, ...]:
    """Weights, gradients and Adam states of ``parameters`` held by one GPU. In 16-bit
    mixed precision: 2 + 2 + 12 bytes per parameter (the 32-bit master copy and two
    moments; Rajbhandari et al. 2020, ZeRO, Sec. 3.1), 16 in all; in float32, 4 + 4 + 8.
    The distributed optimizer (ZeRO-1) shards the optimizer states over the ``dp``
    replicas."""
    e = cluster.value_bytes
    optimizer = (16 - 2 * e) * parameters
    if layout.distributed_optimizer:
        optimizer /= layout.dp
    return e * parameters, e * parameters, optimizer


def layer_activation_bytes(model: Model, cluster: Cluster, layout: Layout,
                           recompute: str | None = None) -> float:
    """Activations one layer keeps for its backward, per micro-batch (Korthikanti et al.
    2022, Table 2, in 16-bit values with 1-byte dropout masks). Per token: 10·h bytes
    that every tensor-parallel GPU holds whole (two norm inputs, the attention and MLP
    inputs, two dropout masks) unless the sequence is split, 24·h split over t (query,
    key, value, the attention output, the MLP's inner activations), and 5·a·s/t for the
    attention scores (softmax output, dropout mask and output), which flash attention and
    selective recompute do not keep. Full recompute keeps only the layer input, 2·s·b·h.
    Grouped-query attention and gated MLPs scale the split part by their widths."""
    recompute = layout.recompute if recompute is None else recompute
    t, b, s, h = layout.tp, layout.micro_batch, model.seq_len, model.hidden
    tokens = b * s
    if recompute == "full":
        return 2.0 * tokens * h * cluster.value_bytes / 2
    kv_width = model.kv * (h // model.heads)
    shared = 10 * h / (t if layout.sequence_parallel else 1)
    split = (4 * h + 4 * kv_width + 2 * model.mlp_matrices * model.ffn) / t
    scores = 0.0 if recompute == "selective" or layout.flash_attention else \
        5 * model.heads * s / t
    return tokens * (shared + split + scores) * cluster.value_bytes / 2


def logits_bytes(model: Model, layout: Layout) -> float:
    """The last chunk's float32 logits (softmax kept for the backward), per micro-batch."""
    return 4.0 * layout.micro_batch * model.seq_len * model.vocab / layout.tp
