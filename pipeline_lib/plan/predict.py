"""`predict`: one training step of a layout, priced and simulated.

The pipeline part is `pipeline_lib.timeline.simulate` on the named schedule, built by
`pipeline_lib.schedules.build`, with each chunk's seconds per action (`costs`) and the
time of one stage-to-stage message as ``comm``: the same schedule objects that the
executors run. Around it: the data-parallel gradient reduction, which starts bucket by
bucket during each chunk's last backward and hides as far as the rest of the step lets
it, and the optimizer step, which reads and writes every state once.
"""
from __future__ import annotations

from dataclasses import dataclass

from pipeline_lib.plan.costs import (ChunkCosts, as_executed, chunk_costs, message_seconds,
                                     ring_seconds)
from pipeline_lib.plan.hardware import CLUSTERS, Cluster
from pipeline_lib.plan.memory import Memory, layer_activation_bytes, logits_bytes, state_bytes
from pipeline_lib.plan.model import Layout, Model, check_fits
from pipeline_lib.schedules import Schedule, build
from pipeline_lib.timeline import Timeline, simulate

ADAM_BYTES = 28   # per parameter: read master, gradient, two moments; write three and a copy


@dataclass(frozen=True)
class Plan:
    """A predicted training step. Times in seconds; ``memory`` in bytes (busiest GPU).

    ``tflops_per_gpu`` counts the FLOPs the GPUs execute (a full recompute's second
    forward included, as Narayanan et al. 2021 report theirs); ``mfu`` counts only the
    model's (Chowdhery et al. 2022's model FLOPs utilisation: no recompute)."""

    model: Model
    cluster: Cluster
    layout: Layout
    step_time: float
    memory: Memory
    mfu: float
    tflops_per_gpu: float
    timeline: Timeline
    bubble_fraction: float
    pipeline_time: float        # the simulated makespan of the micro-batches
    data_parallel_time: float   # the gradient reduction not hidden behind the backwards
    optimizer_time: float
    message_time: float         # one activation between two stages (simulate's comm)
    costs: ChunkCosts

    @property
    def fits(self) -> bool:
        return self.memory <= self.cluster.hbm_bytes


def as_cluster(cluster: Cluster | str) -> Cluster:
    if isinstance(cluster, Cluster):
        return cluster
    if cluster not in CLUSTERS:
        raise ValueError(f"unknown cluster {cluster!r}; choose one of {sorted(CLUSTERS)} "
                         f"or build a Cluster(...)")
    return CLUSTERS[cluster]


def chunk_parameters(model: Model, layout: Layout, layers: list[int]) -> list[float]:
    """Parameters of each chunk held by one tensor-parallel GPU; the first and the last
    chunk each hold the vocabulary embedding (tied: the last keeps a copy)."""
    last = len(layers) - 1
    return [(n * model.layer_parameters()
             + model.vocab * model.hidden * ((c == 0) + (c == last and last > 0))) / layout.tp
            for c, n in enumerate(layers)]


def data_parallel_bandwidth(cluster: Cluster, layout: Layout) -> float:
    """Bus bandwidth of one data-parallel group. Its members sit tp ranks apart; the ones
    in one node reduce over NVLink and share the node's network links between them."""
    t, d, node = layout.tp, layout.dp, cluster.gpus_per_node
    local = 1 if t >= node else min(d, node // t)
    if local == d:
        return cluster.link_bandwidth(inter_node=False)
    return min(cluster.link_bandwidth(False), local * cluster.link_bandwidth(True))


def last_backwards(schedule: Schedule, timeline: Timeline) -> list[tuple[float, float]]:
    """Per chunk, (start, end) of its last backward action: its gradients are complete at
    the end, and a bucketed reduction can start as the action produces them."""
    last: dict[int, tuple[float, float]] = {}
    for e in timeline.events:
        if e.action.kind in ("B", "W") and e.end >= last.get(e.action.stage, (0, -1.0))[1]:
            last[e.action.stage] = (e.start, e.end)
    return [last[s] for s in range(schedule.stages)]


def gradient_reduction(cluster: Cluster, layout: Layout, schedule: Schedule,
                       timeline: Timeline, params: list[float]) -> float:
    """Seconds the data-parallel gradient reduction adds to the step. Each chunk's ring
    starts with its last backward (bucket by bucket, as DDP does) and a rank's chunks
    take turns; whatever ends after the pipeline's last action is exposed. With the
    distributed optimizer it is a reduce-scatter (half the bytes of an all-reduce), and
    the updated weights are all-gathered after the optimizer step, exposed."""
    e, d = cluster.value_bytes, layout.dp
    bandwidth = data_parallel_bandwidth(cluster, layout)
    share = 1.0 if layout.distributed_optimizer else 2.0
    windows = last_backwards(schedule, timeline)
    finish = 0.0
    for r in range(layout.pp):
        done = 0.0
        for c in sorted(schedule.stages_on(r), key=lambda c: windows[c][0]):
            seconds = ring_seconds(e * params[c], d, bandwidth, cluster.latency, share)
            done = max(done, windows[c][0]) + seconds
        finish = max(finish, done)
    exposed = max(0.0, finish - timeline.makespan)
    if layout.distributed_optimizer:
        busiest = max(sum(params[c] for c in schedule.stages_on(r)) for r in range(layout.pp))
        exposed += ring_seconds(e * busiest, d, bandwidth, cluster.latency, 1.0)
    return exposed


def predict(model: Model, cluster: Cluster | str, layout: Layout,
            gpus: int | None = None) -> Plan:
    """Predict one optimizer step of ``model`` trained on ``cluster`` as ``layout`` says
    (on ``gpus`` GPUs, if given: then tp × pp × dp must use exactly that many)."""
    cluster = as_cluster(cluster)
    if gpus is not None and layout.gpus != gpus:
        raise ValueError(f"the layout runs on tp × pp × dp = {layout.tp} × {layout.pp} × "
                         f"{layout.dp} = {layout.gpus} GPUs, not {gpus}: change dp (or tp, "
                         f"pp) so that the product is {gpus}")
    check_fits(model, layout)
    schedule = build(layout.schedule, layout.pp, layout.microbatches, layout.chunks_per_rank)
    costs = as_executed(chunk_costs(model, cluster, layout), cluster,
                       [schedule.rank_of(c) for c in range(schedule.stages)])
    comm = message_seconds(model, cluster, layout)
    timeline = simulate(schedule, costs.forward, costs.backward, costs.weight, comm)
    makespan = timeline.makespan

    params = chunk_parameters(model, layout, costs.layers)
    rank_params = [sum(params[c] for c in schedule.stages_on(r)) for r in range(layout.pp)]
    reduction = gradient_reduction(cluster, layout, schedule, timeline, params)
    optimizer = cluster.memory_seconds(
        ADAM_BYTES * max(rank_params) / (layout.dp if layout.distributed_optimizer else 1))
    step = makespan + reduction + optimizer

    memory = busiest_memory(model, cluster, layout, schedule, timeline, costs, rank_params)
    tokens = layout.global_batch * model.seq_len
    executed = model.flops_per_token(recompute=layout.recompute == "full") * tokens
    useful = model.flops_per_token() * tokens
    return Plan(model, cluster, layout, step, memory,
                useful / (step * layout.gpus * cluster.peak_flops),
                executed / (step * layout.gpus) / 1e12, timeline,
                timeline.bubble_fraction(), makespan, reduction, optimizer,
                comm, costs)


def busiest_memory(model: Model, cluster: Cluster, layout: Layout, schedule: Schedule,
                   timeline: Timeline, costs: ChunkCosts, rank_params: list[float]) -> Memory:
    """The rank with the most bytes: its states, the activations of the micro-batches the
    simulated schedule holds on it at its peak, and a working set: the float32 logits of
    one micro-batch on the rank with the loss (freed once the loss's gradient is out),
    and with full recompute one layer's activations rebuilt for its backward."""
    per_layer = layer_activation_bytes(model, cluster, layout)
    peaks = timeline.peak_activations([n * per_layer for n in costs.layers])
    working = layer_activation_bytes(model, cluster, layout, "none") \
        if layout.recompute == "full" else 0.0
    loss_rank = schedule.rank_of(schedule.stages - 1)
    ranks = [Memory(*state_bytes(rank_params[r], cluster, layout),
                    peaks[r] + working + (logits_bytes(model, layout) if r == loss_rank else 0))
             for r in range(layout.pp)]
    return max(ranks, key=float)
