"""Bytes on one GPU: weights, gradients, optimizer states and activations."""
from __future__ import annotations

from pipeline_lib.plan.hardware import GiB, Cluster
from pipeline_lib.plan.model import Layout, Model


class Memory(float):
    """Bytes on the busiest GPU (a float, so it compares and prints as one; its repr in
    GiB, the unit of a GPU's memory: an "80 GB" GPU has 80 GiB), with the breakdown as attributes: ``weights``, ``gradients``, ``optimizer`` (states) and
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
        gb = lambda x: f"{x / GiB:.1f} GiB"
        return (f"Memory({gb(self)}: weights {gb(self.weights)}, gradients "
                f"{gb(self.gradients)}, optimizer {gb(self.optimizer)}, activations "
                f"{gb(self.activations)})")


def state_bytes(parameters: float, cluster: Cluster, layout: Layout) -> tuple[float, ...]:
    """Weights, gradients and Adam states of ``parameters`` held by one GPU. In 16-bit
    mixed precision: 2 + 2 + 12 bytes per parameter (the 32-bit master copy and two
    moments; Rajbhandari et al. 2020, ZeRO, Sec. 3.1), 16 in all; in float32, 4 + 4 + 8.
    The distributed optimizer (ZeRO stage 1) shards the optimizer states over the ``dp``
    replicas; ``shard_gradients`` (ZeRO stage 2, as FSDP does) the gradients too."""
    e, d = cluster.value_bytes, layout.dp
    optimizer = (16 - 2 * e) * parameters
    gradients = e * parameters
    if layout.distributed_optimizer:
        optimizer /= d
    if layout.shard_gradients:
        gradients /= d
    return e * parameters, gradients, optimizer


def activation_terms(model: Model, cluster: Cluster, layout: Layout,
                     recompute: str | None = None) -> dict[str, float]:
    """What one layer keeps for its backward, per micro-batch, in bytes, term by term:
    Korthikanti et al. 2022, Sec. 4.1, whose sum for a GPT in 16-bit values with 1-byte
    dropout masks is their Table 2 (34·s·b·h + 5·a·s²·b without parallelism).

    * ``norm inputs``, ``norm outputs``: each of the two norms keeps its input, and its
      output is the input of the attention's (or the MLP's) first matrix multiply: 4
      values per token of width h, which every tensor-parallel GPU holds whole unless
      the sequence is split over them too (sequence parallelism).
    * ``dropout masks``: 1 byte per value of each of the two residual dropouts (h each);
      a model without dropout (Llama) keeps none.
    * ``query, key, value``: h + 2·kv_width values, split over t (grouped-query attention
      shrinks K and V to kv_heads · h/heads each).
    * ``attention output``: h values, the output projection's input, split over t.
    * ``MLP inner``: a GeLU MLP keeps the GeLU's input and output (2·ffn); a gated one
      (SwiGLU) both halves of the first projection and their product (3·ffn).
    * ``attention scores``: the s × s softmax output of each of a/t heads, with dropout
      also its 1-byte mask and the dropped-out copy the value multiply reads (5·a·s per
      token in 16 bits, 2·a·s without dropout); selective recompute drops them all.
      Flash attention never writes them (Dao et al. 2022): ``softmax statistics`` keeps
      one float32 log-sum-exp per head per token instead.

    Full recompute keeps only each layer's input: 2·s·b·h (Korthikanti et al., Table 2)."""
    recompute = layout.recompute if recompute is None else recompute
    e, t, b, s, h = cluster.value_bytes, layout.tp, layout.micro_batch, model.seq_len, \
        model.hidden
    tokens = b * s
    if recompute == "full":
        return {"layer input": e * tokens * h}
    shared = tokens / t if layout.sequence_parallel else tokens
    kv_width = model.kv * (h // model.heads)
    heads = model.heads / t
    terms = {"norm inputs": 2 * e * shared * h,
             "norm outputs": 2 * e * shared * h,
             "dropout masks": 2 * shared * h if model.dropout else 0.0,
             "query, key, value": e * tokens * (h + 2 * kv_width) / t,
             "attention output": e * tokens * h / t,
             "MLP inner": e * tokens * (model.mlp_matrices * model.ffn) / t}
    if layout.flash_attention:
        terms["softmax statistics"] = 4 * tokens * heads
    elif recompute != "selective":
        terms["attention scores"] = tokens * heads * s * ((2 * e + 1) if model.dropout
                                                          else e)
    return terms


def layer_activation_bytes(model: Model, cluster: Cluster, layout: Layout,
                           recompute: str | None = None) -> float:
    """Bytes one layer keeps for its backward, per micro-batch: `activation_terms` summed."""
    return sum(activation_terms(model, cluster, layout, recompute).values())


def logits_bytes(model: Model, layout: Layout) -> float:
    """The last chunk's float32 logits (softmax kept for the backward), per micro-batch."""
    return 4.0 * layout.micro_batch * model.seq_len * model.vocab / layout.tp
