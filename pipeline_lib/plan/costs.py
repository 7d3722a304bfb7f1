"""Seconds per action: the forward, backward and weight-gradient time of each model chunk
for one micro-batch, and the time of each message.

Every kernel is priced on a roofline (`Cluster.gemm_seconds`): matrix multiplies by their
FLOPs, norms, softmax, dropout and activations by the bytes they read and write. That is
why a small hidden size reaches a smaller fraction of peak: its elementwise work (∝ h per
token) and its attention scores (∝ s per token) weigh more against its matrix multiplies
(∝ h² per token).

Communication runs on links of its own while the GPU computes; what it adds to an action
depends on what it waits for:

* tensor-parallel collectives run in line (Megatron-LM's default: the next kernel needs
  their result) unless ``Layout.tp_comm_overlap`` pipelines each one with the matrix
  multiply next to it, which then takes the longer of the two (`overlapped`);
* context parallelism's ring passes each chunk of keys and values on while the
  attention of the previous chunk computes (Liu et al. 2023): each of the cp − 1 steps
  takes the longer of the two;
* weights sharded and resharded after the forward (ZeRO-3, FSDP) are gathered before
  each forward and backward, prefetched under the previous layer's compute: the action
  takes the longer of its compute and the gather (`with_sharded_data`).
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


def overlapped(compute: float, communication: float) -> float:
    """A kernel and a transfer that run at once, pipelined in chunks: the longer of the
    two. (A transfer in line with the kernel adds to it instead.)"""
    return max(compute, communication)


def _gemm(cluster: Cluster, m: float, k: float, n: float, accumulate: int = 0,
          fp8: bool = False) -> float:
    """An (m × k) · (k × n) multiply with k × n weights. Its weight gradient (``accumulate``:
    the bytes of one gradient value) reads the m × k input and the m × n output
    gradient, and reads and writes the k × n gradient it adds into, the sum over
    micro-batches (32-bit with Megatron-LM's fp32 main gradients): at a small
    micro-batch, weight-sized traffic that no activation-sized count shows. In ``fp8``
    both inputs are read as 1-byte values (Transformer Engine casts them first: see
    `fp8_casts`)."""
    e = 1 if fp8 else cluster.value_bytes
    out = cluster.value_bytes
    if accumulate:
        nbytes = e * (m * k + m * n) + 2 * accumulate * k * n
    else:
        nbytes = e * (m * k + k * n) + out * m * n
    return cluster.gemm_seconds(2 * m * k * n, nbytes, fp8=fp8)


def block_gemms(model: Model, cluster: Cluster, tokens: float, t: int,
                accumulate: int = 0, fp8: bool = False) -> list[float]:
    """A block's four projections, each on one GPU of the tensor-parallel group:
    query-key-value, output, MLP up (and gate), MLP down."""
    h, f = model.hidden, model.ffn
    return [_gemm(cluster, tokens, h, model.qkv_width / t, accumulate, fp8),
            _gemm(cluster, tokens, h / t, h, accumulate, fp8),
            _gemm(cluster, tokens, h, (model.mlp_matrices - 1) * f / t, accumulate, fp8),
            _gemm(cluster, tokens, f / t, h, accumulate, fp8)]


def fp8_casts(model: Model, cluster: Cluster, tokens: float, t: int) -> Pass:
    """FP8's extra memory traffic per layer. A multiply in FP8 reads FP8 inputs, and the
    weight gradient needs the input transposed: Transformer Engine's fused cast-and-
    transpose writes both (2 bytes per value), the cast fused into the norm or the
    activation that produced the 16-bit input; in the backward each output gradient is
    read (2 bytes) and written likewise (2). The weights' casts are kept from the first
    micro-batch (``is_first_microbatch``), so they are not counted."""
    h, f = model.hidden, model.ffn
    inputs = tokens * (h + h / t + h + f / t)
    outputs = tokens * (model.qkv_width / t + h + (model.mlp_matrices - 1) * f / t + h)
    return Pass(cluster.memory_seconds(2 * inputs, kernels=4),
                cluster.memory_seconds(4 * outputs, kernels=4))


def gradient_bytes(cluster: Cluster, layout: Layout) -> int:
    """Bytes of one accumulated gradient value: 32-bit in Megatron-LM's 18-byte
    convention (`Layout.bytes_per_parameter`), else the values' own."""
    return 4 if layout.bytes_per_parameter == 18 else cluster.value_bytes


def tensor_parallel_link(cluster: Cluster, layout: Layout) -> float:
    """Bandwidth of one tensor-parallel group: its GPUs are consecutive ranks, one node's
    NVLink while t fits in a node."""
    return cluster.link_bandwidth(inter_node=layout.tp > cluster.gpus_per_node)


def context_parallel_link(cluster: Cluster, layout: Layout) -> float:
    """Bandwidth of one context-parallel ring: its GPUs sit tp ranks apart (Megatron-LM
    and Llama 3 order tensor, then context parallelism), in one node while tp·cp fits."""
    return cluster.link_bandwidth(inter_node=layout.tp * layout.cp > cluster.gpus_per_node)


def tensor_parallel_collectives(model: Model, cluster: Cluster, layout: Layout,
                                gemms: list[float], input_grads: list[float],
                                weight_grads: list[float]) -> Pass:
    """Seconds the tensor-parallel collectives add to one layer.

    Forward: one all-gather before the query-key-value and the MLP-up multiplies and one
    reduce-scatter after the output and the MLP-down ones, each of the micro-batch's
    b·s·h activation (with sequence parallelism; without, two all-reduces of the same
    bytes: Korthikanti et al. 2022, Sec. 4.2.2). The backward runs the conjugate four
    on the input gradients, plus, with sequence parallelism, the two all-gathers of the
    sequence-split inputs that the weight gradients need, which Megatron-LM overlaps
    with the input-gradient multiplies. With ``tp_comm_overlap`` each collective is
    pipelined with its multiply (`overlapped`)."""
    t = layout.tp
    if t == 1:
        return Pass()
    e, link = cluster.value_bytes, tensor_parallel_link(cluster, layout)
    tokens = layout.micro_batch * model.seq_len / layout.cp
    one = ring_seconds(e * tokens * model.hidden, t, link, cluster.latency, fraction=1.0)
    regather = 2 * one if layout.sequence_parallel else 0.0
    if layout.tp_comm_overlap:
        forward = sum(overlapped(g, one) - g for g in gemms)
        backward = sum(overlapped(g, one) - g for g in input_grads) \
            + overlapped(weight_grads[0] + weight_grads[2], regather) \
            - weight_grads[0] - weight_grads[2]
    else:
        forward = 4 * one
        backward = 4 * one + overlapped(input_grads[0] + input_grads[2], regather) \
            - input_grads[0] - input_grads[2]
    return Pass(forward, backward, 0.0)


def attention_core(model: Model, cluster: Cluster, layout: Layout) -> Pass:
    """The s × s part of attention on one GPU: Q·Kᵀ, softmax (and its dropout), and the
    value multiply, for its heads / t heads and its s / cp queries (against all s keys:
    context parallelism balances the causal mask's work over the ring, as Megatron-LM's
    does). With context parallelism, the keys and values of each of the cp − 1 other
    chunks arrive over the ring while the previous chunk computes; the backward sends
    their gradients back as well."""
    t, e, b, s = layout.tp, cluster.value_bytes, layout.micro_batch, model.seq_len
    head = model.hidden // model.heads
    heads = model.heads // t
    queries = s / layout.cp
    scores = b * heads * queries * s               # elements of the score matrices
    if layout.flash_attention:
        # causal: the fused kernel skips the masked half; backward recomputes the scores
        flops = 4 * scores * head / 2
        core = Pass(cluster.gemm_seconds(flops, e * 4 * b * heads * queries * head),
                    cluster.gemm_seconds(2.5 * flops, e * 8 * b * heads * queries * head))
    else:
        qk = cluster.gemm_seconds(2 * scores * head,
                                  e * (b * heads * (queries + s) * head + scores))
        # softmax: read e, write e per score; dropout: read e, write e and a 1-byte mask
        drop = model.dropout
        softmax = cluster.memory_seconds((2 * e + (2 * e + 1) * drop) * scores,
                                         kernels=1 + drop)
        core = Pass(2 * qk + softmax,
                    4 * qk + cluster.memory_seconds((3 * e + (2 * e + 1) * drop) * scores,
                                                    kernels=1 + drop))
    cp = layout.cp
    if cp == 1:
        return core
    kv_heads = max(1, model.kv // t)
    chunk = 2 * e * b * queries * kv_heads * head           # one chunk's keys and values
    link = context_parallel_link(cluster, layout)
    send = chunk / link + cluster.latency
    steps = cp - 1
    step_f, step_b = core.forward / cp, core.input_grad / cp
    return Pass(core.forward + steps * (overlapped(step_f, send) - step_f),
                core.input_grad + steps * (overlapped(step_b, 2 * send) - step_b))


def layer_pass(model: Model, cluster: Cluster, layout: Layout) -> tuple[Pass, float]:
    """One Transformer block on one GPU of a tensor-parallel group: its `Pass` (the
    tensor- and context-parallel communication included), and the extra seconds its
    backward spends recomputing (``layout.recompute``)."""
    t, e = layout.tp, cluster.value_bytes
    tokens = layout.micro_batch * model.seq_len / layout.cp
    h = model.hidden
    f = model.ffn
    # replicated elementwise work runs on all tokens unless the sequence is split too
    shared = tokens / t if layout.sequence_parallel else tokens

    gemms = block_gemms(model, cluster, tokens, t, fp8=layout.fp8)
    weight_gemms = block_gemms(model, cluster, tokens, t,
                               accumulate=gradient_bytes(cluster, layout), fp8=layout.fp8)
    core = attention_core(model, cluster, layout)
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
    collectives = tensor_parallel_collectives(model, cluster, layout, gemms, gemms,
                                              weight_gemms)
    layer = Pass(sum(gemms), sum(gemms), sum(weight_gemms)) + core + elementwise \
        + collectives
    if layout.fp8:
        layer += fp8_casts(model, cluster, tokens, t)
    recompute = {"none": 0.0, "full": layer.forward,
                 "selective": 0.0 if layout.flash_attention else core.forward}
    return layer, recompute[layout.recompute]


def embedding_pass(model: Model, cluster: Cluster, layout: Layout) -> Pass:
    """The first chunk's extra work: look up the vocabulary-parallel embedding, reduce
    it over the tensor-parallel group (an all-reduce, or with sequence parallelism a
    reduce-scatter), add its gradient back into the table. That gradient is dense
    (V/t × h): zeroed and written, then added into the accumulated one (read two, write
    one), whatever few rows the micro-batch touched."""
    e, h = cluster.value_bytes, model.hidden
    tokens = layout.micro_batch * model.seq_len / layout.cp
    reduce = ring_seconds(e * tokens * h, layout.tp, tensor_parallel_link(cluster, layout),
                          cluster.latency, 1.0 if layout.sequence_parallel else 2.0)
    table = model.vocab * h / layout.tp
    return Pass(cluster.memory_seconds((4 * e + 1) * tokens * h, kernels=2) + reduce, 0.0,
                cluster.memory_seconds(3 * e * tokens * h + 4 * e * table, kernels=3))


def loss_pass(model: Model, cluster: Cluster, layout: Layout) -> Pass:
    """The last chunk's extra work: the final norm, the vocabulary projection (each GPU
    V/t of it, 16-bit even in FP8 runs) and the cross-entropy over float32 logits (read,
    max, exp, sum: about 12 bytes per logit forward, 4 + e backward). With sequence
    parallelism the norm's output is all-gathered first (and its gradient
    reduce-scattered); without, the input gradient is all-reduced."""
    e, t, h = cluster.value_bytes, layout.tp, model.hidden
    tokens = layout.micro_batch * model.seq_len / layout.cp
    logits = tokens * model.vocab / t
    projection = _gemm(cluster, tokens, h, model.vocab / t)
    link = tensor_parallel_link(cluster, layout)
    sp = layout.sequence_parallel
    gather = ring_seconds(e * tokens * h, t, link, cluster.latency, 1.0) if sp else 0.0
    reduce = ring_seconds(e * tokens * h, t, link, cluster.latency, 1.0 if sp else 2.0)
    norm = cluster.memory_seconds(2 * e * (tokens / t if sp else tokens) * h)
    return Pass(projection + norm + gather
                + cluster.memory_seconds((12 + e) * logits, kernels=2),
                projection + reduce + norm + cluster.memory_seconds((4 + e) * logits,
                                                                    kernels=2),
                _gemm(cluster, tokens, h, model.vocab / t,
                      accumulate=gradient_bytes(cluster, layout)))


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
    if layout.tp > 1 or layout.cp > 1 or counted.tokens != tokens:
        raise ValueError(f"the model's kernels were counted on one device at micro-batches "
                         f"of {counted.tokens} tokens; this layout runs tp = {layout.tp}, "
                         f"cp = {layout.cp} at {tokens} tokens (micro_batch "
                         f"{layout.micro_batch} × seq_len {model.seq_len}): count them at "
                         f"the layout's micro-batch (`plan.kernels.count_kernels`) with "
                         f"tp = cp = 1")
    block = counted_pass(counted.block, cluster, _weight_share(layer))
    return (block, block.forward if layout.recompute == "full" else 0.0,
            counted_pass(counted.embedding, cluster, _weight_share(first)),
            counted_pass(counted.head, cluster, _weight_share(last)))


def chunk_layers(model: Model, layout: Layout) -> list[int]:
    """Layers of each model chunk (the schedule's stages), as the layout splits them."""
    return layers_per_chunk(model.layers, layout.chunks, layout.first_stage_layers,
                            layout.last_stage_layers)


def chunk_costs(model: Model, cluster: Cluster, layout: Layout) -> ChunkCosts:
    layer, recompute, first, last = passes(model, cluster, layout)
    layers = chunk_layers(model, layout)
    forward, backward, weight = [], [], []
    for c, n in enumerate(layers):
        work = layer * n
        work += first if c == 0 else Pass()
        work += last if c == len(layers) - 1 else Pass()
        forward.append(work.forward)
        backward.append(work.input_grad + work.weight_grad + n * recompute)
        weight.append(work.weight_grad)
    return ChunkCosts(layers, forward, backward, weight)


def with_sharded_data(costs: ChunkCosts, cluster: Cluster, layout: Layout,
                      params: list[float], bandwidth: float) -> ChunkCosts:
    """``costs`` with the data-parallel traffic of weights that are resharded after each
    forward (ZeRO-3, FSDP's default): each forward first all-gathers its chunk's weights
    over the dp·cp replicas, and each backward gathers them again and reduce-scatters
    their gradients, layer by layer on the same link, prefetched under the neighbouring
    layers' compute, so an action takes the longer of its compute and its traffic
    (`overlapped`). (Sharded gradients of weights kept whole wait for nothing: their
    reduce-scatter is priced as a stream of its own, `predict.gradient_reduction`.)"""
    if not (layout.shard_parameters and layout.reshard_after_forward):
        return costs
    e, r = cluster.value_bytes, layout.replicas
    forward, backward, weight = [], [], []
    for c, (f, b, w) in enumerate(zip(costs.forward, costs.backward, costs.weight)):
        gather = ring_seconds(e * params[c], r, bandwidth, cluster.latency, 1.0)
        scatter = ring_seconds(gradient_bytes(cluster, layout) * params[c], r, bandwidth,
                               cluster.latency, 1.0)
        total = overlapped(b, gather + scatter)
        forward.append(overlapped(f, gather))
        backward.append(total)
        weight.append(w * total / b if b else 0.0)
    return replace(costs, forward=forward, backward=backward, weight=weight)


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
    fastest, then context-, then data-parallel, then pipeline (Megatron-LM), so
    consecutive stages sit tp·cp·dp ranks apart: once the job spans several nodes, some
    boundary is between two."""
    return layout.pp > 1 and layout.gpus > cluster.gpus_per_node


def message_seconds(model: Model, cluster: Cluster, layout: Layout) -> float:
    """One activation (or its gradient) from a stage to the next: micro_batch × seq / cp
    × hidden values. Megatron-LM's scatter/gather (Narayanan et al. 2021, Sec. 4.1) sends
    a 1/t slice from each tensor-parallel GPU and all-gathers it over NVLink on arrival;
    with sequence parallelism the activation is already split."""
    e, t = cluster.value_bytes, layout.tp
    nbytes = e * layout.micro_batch * model.seq_len / layout.cp * model.hidden
    seconds = nbytes / t / cluster.link_bandwidth(crosses_nodes(layout, cluster)) \
        + cluster.latency
    if t > 1 and not layout.sequence_parallel:
        seconds += ring_seconds(nbytes, t, tensor_parallel_link(cluster, layout),
                                cluster.latency, fraction=1.0)
    return seconds
