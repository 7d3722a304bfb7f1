"""Bytes on one GPU: weights, gradients, optimizer states, activations, and what the
process holds besides. `busiest_memory` is the one count that `predict` and `search`
both give: what the schedule keeps in flight comes from the schedule's own order
(`held_peaks`), not from a timing."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pipeline_lib.plan.costs import gradient_bytes
from pipeline_lib.plan.hardware import GiB, Cluster
from pipeline_lib.plan.model import Layout, Model
from pipeline_lib.schedules import Schedule, build, rounds


class Memory(float):
    """Bytes on the busiest GPU (a float, so it compares and prints as one; its repr in
    GiB, the unit of a GPU's memory: an "80 GB" GPU has 80 GiB), with the breakdown as
    attributes: ``weights``, ``gradients``, ``optimizer`` (states), ``activations``
    (what the schedule keeps in flight, plus one layer's working set) and ``reserved``
    (`Cluster.reserved_bytes`: the CUDA context, NCCL's buffers, the allocator's slack)."""

    weights: float
    gradients: float
    optimizer: float
    activations: float
    reserved: float

    def __new__(cls, weights: float, gradients: float, optimizer: float,
                activations: float, reserved: float = 0.0) -> "Memory":
        self = super().__new__(cls, weights + gradients + optimizer + activations + reserved)
        self.weights, self.gradients = weights, gradients
        self.optimizer, self.activations, self.reserved = optimizer, activations, reserved
        return self

    @property
    def total(self) -> float:
        return float(self)

    def __repr__(self) -> str:
        gb = lambda x: f"{x / GiB:.1f} GiB"
        return (f"Memory({gb(self)}: weights {gb(self.weights)}, gradients "
                f"{gb(self.gradients)}, optimizer {gb(self.optimizer)}, activations "
                f"{gb(self.activations)}, reserved {gb(self.reserved)})")


def state_bytes(parameters: float, cluster: Cluster, layout: Layout) -> tuple[float, ...]:
    """Weights, gradients and Adam states of ``parameters`` held by one GPU, in the
    layout's convention (`Layout.bytes_per_parameter`): 16-bit mixed precision keeps
    2 + 2 + 12 bytes per parameter (ZeRO's 16: 16-bit gradients; Rajbhandari et al. 2020,
    Sec. 3.1) or 2 + 4 + 12 (Megatron-LM's 18: 32-bit gradients); float32 4 + 4 + 8.
    ZeRO's stages shard them over the dp·cp replicas: the optimizer states
    (``distributed_optimizer``: Megatron-LM's 6 + 12/d with 32-bit gradients), the
    gradients too (``shard_gradients``), the weights too (``shard_parameters``)."""
    e, r = cluster.value_bytes, layout.replicas
    weights = e * parameters / (r if layout.shard_parameters else 1)
    gradients = gradient_bytes(cluster, layout) * parameters \
        / (r if layout.shard_gradients else 1)
    optimizer = (16 - 2 * e) * parameters / (r if layout.distributed_optimizer else 1)
    return weights, gradients, optimizer


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

    In FP8 (Transformer Engine) a multiply saves its input as it read it, in FP8: the
    norms' outputs, the attention output and the MLP's activation output are kept at 1
    byte per value. Context parallelism splits the tokens over cp GPUs: every term
    shrinks by cp.
    Full recompute keeps only each layer's input: 2·s·b·h (Korthikanti et al., Table 2),
    split over t too with sequence parallelism (the input is then sequence-split)."""
    recompute = layout.recompute if recompute is None else recompute
    e, t, h = cluster.value_bytes, layout.tp, model.hidden
    tokens = layout.micro_batch * model.seq_len / layout.cp
    shared = tokens / t if layout.sequence_parallel else tokens
    if recompute == "full":
        return {"layer input": e * shared * h}
    kv_width = model.kv * (h // model.heads)
    heads = model.heads / t
    saved = 1 if layout.fp8 else e                 # a multiply's saved input
    f = model.ffn
    terms = {"norm inputs": 2 * e * shared * h,
             "norm outputs": 2 * saved * shared * h,
             "dropout masks": 2 * shared * h if model.dropout else 0.0,
             "query, key, value": e * tokens * (h + 2 * kv_width) / t,
             "attention output": saved * tokens * h / t,
             "MLP inner": tokens * (e * (model.mlp_matrices - 1) * f + saved * f) / t}
    if layout.flash_attention:
        terms["softmax statistics"] = 4 * tokens * heads
    elif recompute != "selective":
        terms["attention scores"] = tokens * heads * model.seq_len * (
            (2 * e + 1) if model.dropout else e)
    return terms


def layer_activation_bytes(model: Model, cluster: Cluster, layout: Layout,
                           recompute: str | None = None) -> float:
    """Bytes one layer keeps for its backward, per micro-batch: `activation_terms` summed."""
    return sum(activation_terms(model, cluster, layout, recompute).values())


def embedding_activation_bytes(model: Model, layout: Layout) -> float:
    """What the first chunk keeps per micro-batch besides its layers: the token ids
    (8-byte integers, whole on every tensor-parallel GPU) and, with dropout, the
    embedding dropout's 1-byte mask (split over t with sequence parallelism): Megatron-LM
    counts both (``theoretical_memory_usage.py``, "input to embedding" and "dropout in
    embedding layer")."""
    tokens = layout.micro_batch * model.seq_len / layout.cp
    mask = tokens * model.hidden / (layout.tp if layout.sequence_parallel else 1)
    return 8 * tokens + (mask if model.dropout else 0.0)


def logits_bytes(model: Model, layout: Layout) -> float:
    """The last chunk's float32 logits (softmax kept for the backward), per micro-batch."""
    return 4.0 * layout.micro_batch * model.seq_len / layout.cp * model.vocab / layout.tp


# -- what a schedule keeps in flight -------------------------------------------------------

def held_peaks(schedule: Schedule, sizes: Sequence[float]) -> list[float]:
    """Per rank, the most bytes of activations it holds at once, walking its own order of
    actions: a micro-batch's ``sizes[stage]`` are taken by its forward and released by
    its last backward action (B, or the W of a split one). A rank runs its actions one
    after another, so this is what any timing of the schedule holds
    (`Timeline.peak_activations`, which `simulate`'s timelines give, agrees)."""
    return [float(held.max()) for held in _walked(schedule, [np.asarray(sizes, float)])]


def _walked(schedule: Schedule, vectors: list[np.ndarray]) -> list[np.ndarray]:
    """Per rank, the held sums of each of ``vectors`` (per stage) after each forward."""
    split = {(a.stage, a.microbatch) for actions in schedule.actions for a in actions
             if a.kind == "W"}
    sizes = np.stack(vectors, axis=1)
    out = []
    for actions in schedule.actions:
        held = np.zeros(len(vectors))
        rows = [held.copy()]
        for a in actions:
            if a.kind == "F":
                held = held + sizes[a.stage]
                rows.append(held)
            elif a.kind in ("B", "W") or (a.kind == "I" and (a.stage, a.microbatch)
                                          not in split):
                held = held - sizes[a.stage]
        out.append(np.array(rows))
    return out


# The builders of `pipeline_lib.schedules` whose ranks each run `one_forward_one_backward`:
# ``ahead(p, m, v, r, first round)`` forwards before the first backward, weights ``lag(r)``
# backwards late (None: unsplit), micro-batches in `rounds` (True), one by one through
# each chunk (None: looped_bfs) or on one chunk (False).
_FAMILIES = {
    "gpipe": (lambda p, m, v, r, g: m, None, False),
    "1f1b": (lambda p, m, v, r, g: p - r, None, False),
    "zb_h1": (lambda p, m, v, r, g: p - r, lambda r: r, False),
    "zb_h2": (lambda p, m, v, r, g: 2 * (p - r) - 1, lambda r: 2 * r, False),
    "interleaved_1f1b": (lambda p, m, v, r, g: (v - 1) * g + 2 * (p - 1 - r) + 1, None, True),
    "interleaved_zero_bubble": (lambda p, m, v, r, g: (v - 1) * g + (p - 1 - r) + 1,
                                lambda r: r, True),
    "looped_bfs": (lambda p, m, v, r, g: m * v, None, None),
}


def held_windows(name: str, ranks: int, microbatches: int, virtual_stages: int,
                 vectors: Sequence[Sequence[float]], which: Sequence[int]) -> list[np.ndarray]:
    """For each rank in ``which``, the held sums of each of ``vectors`` (one value per
    stage) at every moment a forward has just started: a (moments × vectors) array, whose
    column maxima are `held_peaks`. Without building the schedule: a rank's forwards and
    backwards come in a known order (`_FAMILIES`), and the held sums after each forward
    are two prefix sums apart. Schedules built otherwise (zb_v, dualpipe_v) are built and
    walked. Tests check both against `held_peaks` of the built schedule."""
    p, m, v = ranks, microbatches, virtual_stages
    sizes = np.stack([np.asarray(vec, dtype=float) for vec in vectors], axis=1)
    if name not in _FAMILIES:
        walked = _walked(build(name, p, m, v), [sizes[:, k] for k in range(sizes.shape[1])])
        return [walked[r] for r in which]
    ahead, lag, looped = _FAMILIES[name]
    groups = rounds(p, m) if looped else [range(m)]
    out = []
    for r in which:
        chunks = np.arange(v) * p + r if looped is not False else np.array([r])
        if looped is None:                    # each chunk through all m, then the next
            forward = np.repeat(sizes[chunks], m, axis=0)
            backward = np.repeat(sizes[chunks[::-1]], m, axis=0)
        else:
            forward = np.concatenate([np.repeat(sizes[chunks], len(g), axis=0)
                                      for g in groups])
            backward = np.concatenate([np.repeat(sizes[chunks[::-1]], len(g), axis=0)
                                       for g in groups])
        n = len(forward)
        a = min(ahead(p, m, v, r, len(groups[0])), n)
        late = lag(r) if lag is not None else 0
        zero = np.zeros((1, sizes.shape[1]))
        taken = np.concatenate([zero, np.cumsum(forward, axis=0)])
        released = np.concatenate([zero, np.cumsum(backward, axis=0)])
        k = np.arange(n - a)                       # the k-th backward, then a forward
        moments = taken[a + k + 1] - released[np.maximum(k + 1 - late, 0)]
        out.append(np.concatenate([taken[:a + 1], moments]))
    return out


def schedule_peaks(name: str, ranks: int, microbatches: int, virtual_stages: int,
                   sizes: Sequence[float], which: Sequence[int] | None = None) -> list[float]:
    """`held_peaks` of the named schedule for the ranks in ``which`` (all by default),
    from `held_windows`."""
    which = range(ranks) if which is None else which
    return [float(w[:, 0].max()) for w in held_windows(name, ranks, microbatches,
                                                       virtual_stages, [sizes], which)]


def rank_chunks(layout: Layout, rank: int) -> list[int]:
    """The model chunks (schedule stages) pipeline rank ``rank`` holds: looped schedules
    put chunk c on rank c mod p, V-shaped ones r and 2p − 1 − r."""
    p, v = layout.pp, layout.chunks_per_rank
    if layout.schedule in ("zb_v", "dualpipe_v"):
        return [rank, 2 * p - 1 - rank]
    return [c * p + rank for c in range(v)]


def chunk_parameters(model: Model, layout: Layout, layers: list[int]) -> list[float]:
    """Parameters of each chunk held by one tensor-parallel GPU; the first chunk holds
    the vocabulary embedding, the last the output projection (tied: a copy of it; on a
    single chunk, tied weights once, untied twice)."""
    last = len(layers) - 1
    table = model.vocab * model.hidden
    per_layer = model.layer_parameters()
    return [(n * per_layer + table * ((c == 0) + (c == last and (last > 0 or not
                                                                 model.tied_embeddings))))
            / layout.tp for c, n in enumerate(layers)]


def activation_sizes(model: Model, cluster: Cluster, layout: Layout,
                     layers: list[int]) -> list[float]:
    """Per chunk, the bytes one micro-batch keeps in it until its backward."""
    per_layer = layer_activation_bytes(model, cluster, layout)
    return [n * per_layer + (embedding_activation_bytes(model, layout) if c == 0 else 0.0)
            for c, n in enumerate(layers)]


def busiest_memory(model: Model, cluster: Cluster, layout: Layout, layers: list[int],
                   held: Sequence[float], ranks: Sequence[int] | None = None) -> Memory:
    """The rank with the most bytes: its states (`state_bytes`), the activations its
    schedule holds at its peak (``held``, per rank in ``ranks``: `schedule_peaks`), and
    a working set: the float32 logits of one micro-batch on the rank with the loss
    (freed once the loss's gradient is out); with full recompute one layer's
    activations rebuilt for its backward; with sharded weights the gathered copies (of
    the two layers in flight, or, kept from forward to backward, of all the rank's
    chunks) and with sharded gradients one layer's unsharded gradient; plus the
    cluster's ``reserved_bytes``."""
    ranks = range(layout.pp) if ranks is None else ranks
    loss_rank = layout.pp - 1 if layout.schedule not in ("zb_v", "dualpipe_v") else 0
    working = layer_activation_bytes(model, cluster, layout, "none") \
        if layout.recompute == "full" else 0.0
    layer_params = model.layer_parameters() / layout.tp
    table = model.vocab * model.hidden / layout.tp
    last = len(layers) - 1
    e = cluster.value_bytes
    best, most = None, -1.0
    for r, peak in zip(ranks, held):
        owned = rank_chunks(layout, r)
        mine = sum(layers[c] for c in owned) * layer_params + table * (
            (0 in owned) + (last in owned and (last > 0 or not model.tied_embeddings)))
        weights, gradients, optimizer = state_bytes(mine, cluster, layout)
        if layout.shard_parameters:
            weights += e * (2 * layer_params if layout.reshard_after_forward else mine)
        if layout.shard_gradients:
            gradients += gradient_bytes(cluster, layout) * layer_params
        activations = peak + working + (logits_bytes(model, layout) if r == loss_rank else 0)
        total = weights + gradients + optimizer + activations
        if total > most:
            best, most = (weights, gradients, optimizer, activations), total
    return Memory(*best, cluster.reserved_bytes)
