"""Seconds per action: the forward, backward and weight-gradient time of each model chunk
for one micro-batch, and the time of each message.

Every kernel is priced on a roofline (`Cluster.gemm_seconds`): matrix multiplies by their
FLOPs, norms, softmax, dropout and activations by the bytes they read and write. That is
why a small hidden size reaches a smaller fraction of peak: its elementwise work (∝ h per
token) and its attention scores (∝ s per token) weigh more against its matrix multiplies
(∝ h² per token). Tensor-parallel collectives are not overlapped with compute (Megatron-LM
runs them in line), so they add to the action that issues them.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from pipeline_lib.plan.hardware import Cluster
from pipeline_lib.plan.model import Layout, Model, Passes, layers_per_chunk


@dataclass(frozen=True)
class Pass:
    """Seconds of one pass over one layer (or the embedding, or the loss) for one
    micro-batch: ``forward``, ``input_grad`` (I) and ``weight_grad`` (W)."""

    forward: float = 0.0
    input_grad: float = 0.0
    weight_grad: float = 0.0

    def __add__(self, other: "Pass") -> "Pass":
        return Pass(self.forward + other.forward, self.input_grad + other.input_grad,
                    self.weight_grad + other.weight_grad)

    def __mul__(self, k: float) -> "Pass":
        return Pass(self.forward * k, self.input_grad * k, self.weight_grad * k)


def ring_seconds(nbytes: float, ranks: int, bandwidth: float, latency: float,
                 fraction: float = 2.0) -> float:
    """A ring collective over ``ranks``: each rank moves ``fraction·(n−1)/n`` of the bytes
    (2 for an all-reduce, 1 for a reduce-scatter or an all-gather; nccl-tests
    doc/PERFORMANCE.md) in ``fraction·(n−1)`` latency-bound steps."""
    if ranks == 1:
        return 0.0
    steps = fraction * (ranks - 1)
    return steps / ranks * nbytes / bandwidth + steps * latency


def _gemm(cluster: Cluster, m: float, k: float, n: float, accumulate: bool = False) -> float:
    """An (m × k) · (k × n) multiply with k × n weights. Its weight gradient (``accumulate``)
    also reads the k × n gradient it adds into, the sum over micro-batches: at a small
    micro-batch, weight-sized traffic that no activation-sized count shows."""
    e = cluster.value_bytes
    return cluster.gemm_seconds(2 * m * k * n, e * (m * k + (1 + accumulate) * k * n + m * n))


def _block_gemms(model: Model, cluster: Cluster, tokens: float, t: int,
                 accumulate: bool = False) -> float:
    """A block's four projections: query-key-value, output, MLP up (and gate), MLP down."""
    h, f = model.hidden, model.ffn
    return (_gemm(cluster, tokens, h, model.qkv_width / t, accumulate)
            + _gemm(cluster, tokens, h / t, h, accumulate)
            + _gemm(cluster, tokens, h, (model.mlp_matrices - 1) * f / t, accumulate)
            + _gemm(cluster, tokens, f / t, h, accumulate))


def layer_pass(model: Model, cluster: Cluster, layout: Layout) -> tuple[Pass, float]:
    """One Transformer block on one GPU of a tensor-parallel group: its `Pass` (the
    tensor-parallel collectives included), and the extra seconds its backward spends
    recomputing (``layout.recompute``)."""
    t, e = layout.tp, cluster.value_bytes
    b, s, h, f = layout.micro_batch, model.seq_len, model.hidden, model.ffn
    tokens = b * s
    head = h // model.heads
    heads = model.heads // t
    # replicated elementwise work runs on all tokens unless the sequence is split too
    shared = tokens / t if layout.sequence_parallel else tokens

    gemms = _block_gemms(model, cluster, tokens, t)
    weight_gemms = _block_gemms(model, cluster, tokens, t, accumulate=True)
    scores = b * heads * s * s                     # elements of the s × s score matrices
    if layout.flash_attention:
        # causal: the fused kernel skips the masked half; backward recomputes the scores
        flops = 4 * scores * head / 2
        core = Pass(cluster.gemm_seconds(flops, e * 4 * b * heads * s * head),
                    cluster.gemm_seconds(2.5 * flops, e * 8 * b * heads * s * head))
    else:
        qk = cluster.gemm_seconds(2 * scores * head, e * (2 * b * heads * s * head + scores))
        # softmax: read e, write e per score; dropout: read e, write e and a 1-byte mask
        drop = model.dropout
        softmax = cluster.memory_seconds((2 * e + (2 * e + 1) * drop) * scores,
                                         kernels=1 + drop)
        core = Pass(2 * qk + softmax,
                    4 * qk + cluster.memory_seconds((3 * e + (2 * e + 1) * drop) * scores,
                                                    kernels=1 + drop))
    act_in = model.mlp_matrices * e * tokens * f / t         # GeLU: read f, write f
    # each residual add reads two values and writes one; with dropout, also a mask,
    # and its backward applies the mask (without, the add's gradient passes through)
    drop = model.dropout
    elementwise = Pass(cluster.memory_seconds(2 * 2 * e * shared * h            # 2 norms
                                              + 2 * (3 * e + drop) * shared * h  # (dropout-)add
                                              + act_in, kernels=5),
                       cluster.memory_seconds(2 * 3 * e * shared * h
                                              + 2 * (2 * e + 1) * drop * shared * h
                                              + act_in * (model.mlp_matrices + 1)
                                              / model.mlp_matrices, kernels=3 + 2 * drop))
    link = cluster.link_bandwidth(inter_node=t > cluster.gpus_per_node)
    collective = 2 * ring_seconds(e * tokens * h, t, link, cluster.latency)
    layer = Pass(gemms, gemms, weight_gemms) + core + elementwise + Pass(collective, collective)
    recompute = {"none": 0.0, "full": layer.forward,
                 "selective": 0.0 if layout.flash_attention else core.forward}
    return layer, recompute[layout.recompute]


def embedding_pass(model: Model, cluster: Cluster, layout: Layout) -> Pass:
    """The first chunk's extra work: look up the vocabulary-parallel embedding, all-reduce
    it over the tensor-parallel group, add its gradient back into the table. That gradient
    is dense (V/t × h): zeroed and written, then added into the accumulated one (read
    two, write one), whatever few rows the micro-batch touched."""
    e, tokens, h = cluster.value_bytes, layout.micro_batch * model.seq_len, model.hidden
    link = cluster.link_bandwidth(inter_node=layout.tp > cluster.gpus_per_node)
    reduce = ring_seconds(e * tokens * h, layout.tp, link, cluster.latency)
    table = model.vocab * h / layout.tp
    return Pass(cluster.memory_seconds((4 * e + 1) * tokens * h, kernels=2) + reduce, 0.0,
                cluster.memory_seconds(3 * e * tokens * h + 4 * e * table, kernels=3))


def loss_pass(model: Model, cluster: Cluster, layout: Layout) -> Pass:
    """The last chunk's extra work: the final norm, the vocabulary projection (each GPU
    V/t of it) and the cross-entropy over float32 logits (read, max, exp, sum: about 12
    bytes per logit forward, 4 + e backward)."""
    e, t = cluster.value_bytes, layout.tp
    tokens, h = layout.micro_batch * model.seq_len, model.hidden
    logits = tokens * model.vocab / t
    projection = _gemm(cluster, tokens, h, model.vocab / t)
    link = cluster.link_bandwidth(inter_node=t > cluster.gpus_per_node)
    reduce = ring_seconds(e * tokens * h, t, link, cluster.latency)
    norm = cluster.memory_seconds(2 * e * tokens * h)
    return Pass(projection + norm + cluster.memory_seconds((12 + e) * logits, kernels=2),
                projection + reduce + norm + cluster.memory_seconds((4 + e) * logits,
                                                                    kernels=2),
                _gemm(cluster, tokens, h, model.vocab / t, accumulate=True))


@dataclass(frozen=True)
class ChunkCosts:
    """Per model chunk (the schedule's stages, in model order): seconds of a forward, a
    whole backward (I + W, recompute included) and its W part, for one micro-batch."""

    layers: list[int]
    forward: list[float]
    backward: list[float]
    weight: list[float]


def counted_pass(passes: Passes, cluster: Cluster, weight_share: float = 0.0) -> Pass:
    """Counted kernels (`Kernels`) priced (`Cluster.work_seconds`); ``weight_share`` of
    the backward is its weight gradient (W), as the FLOP formulas split it."""
    forward, backward = (cluster.work_seconds(work, backward=b)
                         for work, b in zip(passes, (False, True)))
    return Pass(forward, backward * (1 - weight_share), backward * weight_share)


def _weight_share(work: Pass) -> float:
    backward = work.input_grad + work.weight_grad
    return work.weight_grad / backward if backward else 0.0


def passes(model: Model, cluster: Cluster, layout: Layout) -> tuple[Pass, float, Pass, Pass]:
    """A block's `Pass` and recompute seconds, the embedding's and the head's `Pass`:
    from the FLOP and byte formulas, or, for a model with counted ``kernels`` (an eager
    CPU run), from those, split into I and W as the formulas split them."""
    layer, recompute = layer_pass(model, cluster, layout)
    first, last = embedding_pass(model, cluster, layout), loss_pass(model, cluster, layout)
    counted = model.kernels
    if counted is None:
        return layer, recompute, first, last
    tokens = layout.micro_batch * model.seq_len
    if layout.tp > 1 or counted.tokens != tokens:
        raise ValueError(f"the model's kernels were counted on one device at micro-batches "
                         f"of {counted.tokens} tokens; this layout runs tp = {layout.tp} at "
                         f"{tokens} tokens (micro_batch {layout.micro_batch} × seq_len "
                         f"{model.seq_len}): count them at the layout's micro-batch "
                         f"(`plan.kernels.count_kernels`) with tp = 1")
    block = counted_pass(counted.block, cluster, _weight_share(layer))
    return (block, block.forward if layout.recompute == "full" else 0.0,
            counted_pass(counted.embedding, cluster, _weight_share(first)),
            counted_pass(counted.head, cluster, _weight_share(last)))


def chunk_costs(model: Model, cluster: Cluster, layout: Layout) -> ChunkCosts:
    layer, recompute, first, last = passes(model, cluster, layout)
    layers = layers_per_chunk(model.layers, layout.chunks)
    forward, backward, weight = [], [], []
    for c, n in enumerate(layers):
        work = layer * n
        work += first if c == 0 else Pass()
        work += last if c == len(layers) - 1 else Pass()
        forward.append(work.forward)
        backward.append(work.input_grad + work.weight_grad + n * recompute)
        weight.append(work.weight_grad)
    return ChunkCosts(layers, forward, backward, weight)


def as_executed(costs: ChunkCosts, cluster: Cluster, rank_of: list[int]) -> ChunkCosts:
    """``costs`` as an executor runs them: each action with `Cluster.action_overhead`,
    and what messages cost the processors at their two ends. Each action that sends to
    another rank pays `Cluster.send_overhead` (a forward to the next chunk's rank, a
    backward, its I, to the previous one's), each that receives from another rank
    `Cluster.receive_overhead` (a forward from the previous chunk's rank, a backward
    from the next one's). A split backward's W, an action of its own, is priced without
    the action overhead (per-stage costs cannot tell which backwards a schedule splits)."""
    last = len(costs.forward) - 1
    send, receive, action = (cluster.send_overhead, cluster.receive_overhead,
                             cluster.action_overhead)
    after = [c > 0 and rank_of[c - 1] != rank_of[c] for c in range(last + 1)]
    before = [c < last and rank_of[c + 1] != rank_of[c] for c in range(last + 1)]
    forward = [f + action + send * before[c] + receive * after[c]
               for c, f in enumerate(costs.forward)]
    backward = [b + action + send * after[c] + receive * before[c]
                for c, b in enumerate(costs.backward)]
    return replace(costs, forward=forward, backward=backward)


def crosses_nodes(layout: Layout, cluster: Cluster) -> bool:
    """Whether some pipeline boundary joins two nodes. Ranks are ordered tensor-parallel
    fastest, then data-parallel, then pipeline (Megatron-LM), so consecutive stages sit
    tp·dp ranks apart: once the job spans several nodes, some boundary is between two."""
    return layout.pp > 1 and layout.gpus > cluster.gpus_per_node


def message_seconds(model: Model, cluster: Cluster, layout: Layout) -> float:
    """One activation (or its gradient) from a stage to the next: micro_batch × seq ×
    hidden values. Megatron-LM's scatter/gather (Narayanan et al. 2021, Sec. 4.1) sends a
    1/t slice from each tensor-parallel GPU and all-gathers it over NVLink on arrival;
    with sequence parallelism the activation is already split."""
    e, t = cluster.value_bytes, layout.tp
    nbytes = e * layout.micro_batch * model.seq_len * model.hidden
    seconds = nbytes / t / cluster.link_bandwidth(crosses_nodes(layout, cluster)) \
        + cluster.latency
    if t > 1 and not layout.sequence_parallel:
        seconds += ring_seconds(nbytes, t, cluster.link_bandwidth(False), cluster.latency,
                                fraction=1.0)
    return seconds
