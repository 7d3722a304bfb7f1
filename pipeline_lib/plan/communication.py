"""Bytes per step on each mesh dimension: the traffic `predict` prices, as bytes rather
than seconds, for comparing with a run's (`pipeline_lib.parallel.traffic.Traffic`
counts them in the run, by the same dimension names).

Bytes are what one GPU *sends*, as a ring does (nccl-tests' bus bandwidth, the
convention `costs.ring_seconds` prices): an all-reduce of ``n`` bytes over ``k`` GPUs
sends ``2(k−1)/k · n`` from each, a reduce-scatter or an all-gather ``(k−1)/k · n``, a
point-to-point message its size. Each term is one that `costs` and `predict` price,
with the same rule:

* ``tp``, per micro-batch (`costs.tensor_parallel_collectives`, `embedding_pass`,
  `loss_pass`, `message_seconds`): each block four collectives of one activation
  forward and four backward, two more backward with sequence parallelism (the inputs
  all-gathered again for the weight gradients), four more forward with full recompute;
  the embedding's sum (an all-reduce, a reduce-scatter under sequence parallelism); the
  loss's all-gather forward (sequence parallelism) and its input gradient's reduction
  backward; and without sequence parallelism, the all-gather that puts each received
  stage-to-stage message back together (Megatron-LM's scatter/gather);
* ``pp``: each message to a stage on another rank, ``1/t`` of the activation from each
  tensor-parallel GPU (`message_seconds`);
* ``dp``, per step (`predict.gradient_reduction`, `costs.with_sharded_data`): the
  gradients all-reduced once (DDP), or reduce-scattered and the updated weights
  all-gathered (the distributed optimizer); sharded gradients reduce-scattered after
  every micro-batch's backward; sharded weights gathered before each forward and
  backward, or once a step when kept.
"""
from __future__ import annotations

from pipeline_lib.plan.costs import chunk_layers, gradient_bytes
from pipeline_lib.plan.hardware import Cluster
from pipeline_lib.plan.memory import chunk_parameters
from pipeline_lib.plan.model import Layout, Model, check_fits
from pipeline_lib.plan.predict import as_cluster, ordered_schedule

DIMENSIONS = ("tp", "pp", "dp")


def communication_bytes(model: Model, cluster: Cluster | str, layout: Layout
                        ) -> list[dict[str, float]]:
    """Per pipeline rank, the bytes one of its GPUs sends in one optimizer step on each
    mesh dimension, ``{"tp": ..., "pp": ..., "dp": ...}`` (see the module docstring).
    ``cluster`` gives the bytes of a value (`Cluster.value_bytes`) and of a gradient."""
    cluster = as_cluster(cluster)
    check_fits(model, layout)
    schedule, _ = ordered_schedule(layout.schedule, layout.pp, layout.microbatches,
                                   layout.chunks_per_rank)
    layers = chunk_layers(model, layout)
    params = chunk_parameters(model, layout, layers)
    e, t, m = cluster.value_bytes, layout.tp, layout.microbatches
    activation = e * layout.micro_batch * model.seq_len / layout.cp * model.hidden
    one = (t - 1) / t * activation      # a reduce-scatter or all-gather of it, per GPU
    sp = layout.sequence_parallel
    last = len(layers) - 1
    sent = [dict.fromkeys(DIMENSIONS, 0.0) for _ in range(layout.pp)]
    for c, n in enumerate(layers):
        here = sent[schedule.rank_of(c)]
        block = (8 + 2 * sp + 4 * (layout.recompute == "full")) * one
        here["tp"] += m * n * block
        if c == 0:
            here["tp"] += m * (1 if sp else 2) * one
        if c == last:   # all-gather forward and reduce-scatter backward, or all-reduce
            here["tp"] += m * 2 * one
        for neighbour in (c - 1, c + 1):   # the activation from c − 1, the gradient from c + 1
            if 0 <= neighbour <= last and schedule.rank_of(neighbour) != schedule.rank_of(c):
                sent[schedule.rank_of(neighbour)]["pp"] += m * activation / t
                if not sp:
                    here["tp"] += m * one
    for rank, here in enumerate(sent):
        here["dp"] = _data_parallel(layout, e, gradient_bytes(cluster, layout),
                                    sum(params[c] for c in schedule.stages_on(rank)))
    return sent


def _data_parallel(layout: Layout, e: int, grad: int, held: float) -> float:
    """One GPU's data-parallel bytes per step for its ``held`` parameters."""
    r, m = layout.replicas, layout.microbatches
    share = (r - 1) / r
    if r == 1:
        return 0.0
    if layout.shard_parameters and layout.reshard_after_forward:
        return m * share * (2 * e + grad) * held        # gather, gather, reduce-scatter
    if layout.shard_gradients:
        return share * (m * grad + e) * held            # a reduce-scatter per micro-batch
    if layout.distributed_optimizer:
        return share * (grad + e) * held                # reduce-scatter, then all-gather
    return 2 * share * grad * held                      # one all-reduce


def executor_bytes(model: Model, cluster: Cluster | str, layout: Layout
                   ) -> list[dict[str, float]]:
    """Per pipeline rank, the bytes one process of `DistributedPipe` sends in a step on
    each mesh dimension: `communication_bytes`, and what the executor (PyTorch's
    tensor-parallel plans, FSDP2 or its ``replicate``) does otherwise, term by term.
    `parallel.traffic.Traffic` counts the same bytes in a run (tests/test_three_d.py,
    notebook 08). ``layout.shard_parameters`` is FSDP, else DDP; ``reshard_after_forward``
    what FSDP does (the executor keeps the weights gathered when the schedule splits its
    backward); no recompute. With t tensor-parallel ranks, d replicas, m micro-batches
    of b rows, an activation of A = e·b·s·h bytes and ``one`` = (t − 1)/t · A:

    tp: the vocabulary-parallel loss reduces three values per token (the logits'
    maximum, the sum of their exponentials, the target's logit: 3 all-reduces of e·b·s
    bytes per micro-batch), which the planner leaves out. Under sequence parallelism,
    PyTorch's plan keeps the gathered input of each column-parallel layer for its weight
    gradient, where Megatron-LM (and the planner) gathers it again in the backward (2
    fewer all-gathers per block and micro-batch); the embedding's sum is an all-reduce,
    each rank then keeping its positions (and all-gathering their gradient back), where
    Megatron-LM reduce-scatters it (2 more halves per micro-batch); and the norms'
    weights and biases get their gradients summed over the tp ranks once a step (4·h
    values per block, all-reduced).

    dp: the planner's ``layer_parameters() / t`` splits every parameter of a block over
    the tp ranks; the norms' weights and biases and the row-parallel layers' biases
    (6·h values per block) are whole on each tp rank; and the output projection's bias
    (V / t per rank) is not in the planner's model. The replicas add up their losses on
    the last stage (one all-reduce of one value). FSDP: the planner reduce-scatters
    sharded gradients after every micro-batch's backward (ZeRO-2/3 as DeepSpeed runs
    them); PyTorch's pipelining runtime, and this one, accumulate whole gradients
    through the step and reduce-scatter once."""
    cluster = as_cluster(cluster)
    if layout.recompute != "none":
        raise ValueError(f"executor_bytes counts runs without recompute, not "
                         f"recompute={layout.recompute!r}")
    planned = communication_bytes(model, cluster, layout)
    schedule, _ = ordered_schedule(layout.schedule, layout.pp, layout.microbatches,
                                   layout.chunks_per_rank)
    layers = chunk_layers(model, layout)
    params = chunk_parameters(model, layout, layers)
    e, h, t, d, m = cluster.value_bytes, model.hidden, layout.tp, layout.replicas, \
        layout.microbatches
    tokens = layout.micro_batch * model.seq_len // layout.cp
    one = (t - 1) / t * e * tokens * h

    def all_reduce(n: float, k: int) -> float:
        return 2 * (k - 1) / k * n

    def half(n: float, k: int) -> float:   # a reduce-scatter or an all-gather
        return (k - 1) / k * n

    sent = []
    for rank, here in enumerate(planned):
        chunks = schedule.stages_on(rank)
        blocks = sum(layers[c] for c in chunks)
        has_loss, has_embedding = len(layers) - 1 in chunks, 0 in chunks
        extra = dict.fromkeys(DIMENSIONS, 0.0)
        if has_loss:
            extra["tp"] += m * 3 * all_reduce(e * tokens, t)
        if layout.sequence_parallel:
            extra["tp"] += m * (2 * one * has_embedding - 2 * one * blocks)
            extra["tp"] += all_reduce(e * 4 * h * blocks, t)
        whole_on_tp = 6 * h * (1 - 1 / t) * blocks + model.vocab / t * has_loss
        if d > 1:
            extra["dp"] += all_reduce(e, d) * has_loss
            if not layout.shard_parameters:
                extra["dp"] += all_reduce(e * whole_on_tp, d)
            else:
                gathers = 2 * m if layout.reshard_after_forward else 1
                extra["dp"] += (gathers + 1) * half(e * whole_on_tp, d)
                extra["dp"] -= (m - 1) * half(e * sum(params[c] for c in chunks), d)
        sent.append({dim: here[dim] + extra[dim] for dim in DIMENSIONS})
    return sent
