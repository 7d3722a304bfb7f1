"""`predict`: one training step of a layout, priced and simulated.

The pipeline part is `pipeline_lib.timeline.simulate` on the named schedule, built by
`pipeline_lib.schedules.build`, with each chunk's seconds per action (`costs`) and the
time of one stage-to-stage message as ``comm``: the same schedule objects that the
executors run. Around it, the data-parallel traffic that is not per micro-batch: the
gradient reduction, which starts bucket by bucket as each chunk's last backward
produces its gradients and hides as far as the rest of the step lets it
(``Layout.overlap_grad_reduce``), the distributed optimizer's all-gather of the updated
weights (after the step, or under the next step's first forwards), and the optimizer
step, which reads and writes every state once.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from pipeline_lib.plan.costs import (ChunkCosts, as_executed, chunk_costs, chunk_layers,
                                     gradient_bytes, message_seconds, ring_seconds,
                                     with_sharded_data)
from pipeline_lib.plan.hardware import CLUSTERS, Cluster
from pipeline_lib.plan.memory import (Memory, activation_sizes, busiest_memory,
                                      chunk_parameters, schedule_peaks)
from pipeline_lib.plan.model import Layout, Model, check_fits
from pipeline_lib.schedules import Action, Schedule, build, cycle_collector_paused, \
    execution_order
from pipeline_lib.timeline import Event, Timeline, _simulate

ADAM_BYTES = 28   # per parameter: read master, gradient, two moments; write three and a copy

__all__ = ["Plan", "predict", "chunk_parameters", "data_parallel_bandwidth"]


@dataclass(frozen=True)
class Plan:
    """A predicted training step. Times in seconds; ``memory`` in bytes (busiest GPU).

    ``tflops_per_gpu`` counts the FLOPs the GPUs execute (a full recompute's second
    forward included, as Narayanan et al. 2021 report theirs); ``mfu`` counts only the
    model's (Chowdhery et al. 2022's model FLOPs utilisation: no recompute), ``hfu``
    the executed ones (hardware FLOPs utilisation, Korthikanti et al. 2022), both
    against the 16-bit peak."""

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
    data_parallel_time: float   # the data-parallel traffic not hidden behind compute
    optimizer_time: float
    message_time: float         # one activation between two stages (simulate's comm)
    costs: ChunkCosts

    @property
    def fits(self) -> bool:
        return self.memory <= self.cluster.hbm_bytes

    @property
    def hfu(self) -> float:
        """Executed FLOPs (recompute included) per second over the 16-bit peak."""
        return self.tflops_per_gpu * 1e12 / self.cluster.peak_flops


def as_cluster(cluster: Cluster | str) -> Cluster:
    if isinstance(cluster, Cluster):
        return cluster
    if cluster not in CLUSTERS:
        raise ValueError(f"unknown cluster {cluster!r}; choose one of {sorted(CLUSTERS)} "
                         f"or build a Cluster(...)")
    return CLUSTERS[cluster]


def data_parallel_bandwidth(cluster: Cluster, layout: Layout) -> float:
    """Bus bandwidth of one group of dp·cp replicas. Its members sit tp ranks apart; the
    ones in one node reduce over NVLink and share the node's network links between
    them."""
    t, r, node = layout.tp, layout.replicas, cluster.gpus_per_node
    local = 1 if t >= node else min(r, node // t)
    if local == r:
        return cluster.link_bandwidth(inter_node=False)
    return min(cluster.link_bandwidth(False), local * cluster.link_bandwidth(True))


def gradient_reduction(cluster: Cluster, layout: Layout, schedule: Schedule,
                       timeline: Timeline, params: list[float], layers: list[int]) -> float:
    """Seconds the data-parallel traffic adds to the step beyond the simulated pipeline.

    The gradient reduction runs on a stream of its own, in buckets of one layer, each
    rank's buckets in turn. With replicated gradients (ZeRO stages 0 and 1) it reduces
    each chunk once, after its last backward (an all-reduce, or with the distributed
    optimizer a reduce-scatter: half the bytes): with ``overlap_grad_reduce`` each
    bucket starts as that backward produces it, layer by layer; without, after the
    rank's last action. Sharded gradients (ZeRO-2/3, FSDP) cannot be summed over the
    micro-batches first: every backward reduce-scatters its chunk's, as it produces
    them (with weights resharded after the forward, within the backward's own traffic:
    `costs.with_sharded_data`). Whatever ends after the pipeline's last action is
    exposed.

    Then the updated weights of ZeRO stages 1 and 2: an all-gather after the optimizer
    step, or with ``overlap_param_gather`` (and for ZeRO-3 weights kept gathered from
    forward to backward, once per step) under the next step's first forwards, bucket by
    bucket, each layer's before that layer's first forward. (ZeRO-3 weights resharded
    after the forward are gathered per action: `costs.with_sharded_data`.)"""
    e, r = cluster.value_bytes, layout.replicas
    if r == 1:
        return 0.0
    bandwidth = data_parallel_bandwidth(cluster, layout)
    grad_bytes = gradient_bytes(cluster, layout)
    share = 1.0 if layout.distributed_optimizer else 2.0
    last_backward: dict[int, Event] = {}
    backwards: list[list[Event]] = [[] for _ in range(layout.pp)]
    first: dict[int, Event] = {}
    for event in timeline.events:
        c = event.action.stage
        if event.action.kind in ("B", "W"):
            backwards[event.rank].append(event)
            if event.end >= last_backward.get(c, event).end:
                last_backward[c] = event
        elif event.action.kind == "F" and (c not in first or event.start < first[c].start):
            first[c] = event
    finish = 0.0
    in_actions = layout.shard_parameters and layout.reshard_after_forward
    for rank, events in enumerate([] if in_actions else backwards):
        if not layout.shard_gradients:
            events = [last_backward[c] for c in schedule.stages_on(rank)]
        events = sorted(events, key=lambda event: event.start)
        done = 0.0 if layout.overlap_grad_reduce else max(e_.end for e_ in events)
        for event in events:
            c = event.action.stage
            buckets = max(layers[c], 1)
            seconds = ring_seconds(grad_bytes * params[c] / buckets, r, bandwidth,
                                   cluster.latency, share)
            for k in range(buckets):
                ready = event.start + (k + 1) / buckets * (event.end - event.start)
                done = max(done, ready) + seconds
        finish = max(finish, done)
    exposed = max(0.0, finish - timeline.makespan)
    if not layout.distributed_optimizer or (layout.shard_parameters
                                            and layout.reshard_after_forward):
        return exposed
    gathered = layout.overlap_param_gather or layout.shard_parameters
    late = 0.0
    for rank in range(layout.pp):
        done = 0.0
        for c in sorted(schedule.stages_on(rank), key=lambda c: first[c].start):
            buckets = max(layers[c], 1)
            seconds = ring_seconds(e * params[c] / buckets, r, bandwidth, cluster.latency, 1.0)
            start, end = first[c].start, first[c].end
            for k in range(buckets):
                done += seconds            # each layer's weights before its forward
                late = max(late, done - (start + k / buckets * (end - start))
                           if gathered else done)
    return exposed + late


def predict(model: Model, cluster: Cluster | str, layout: Layout,
            gpus: int | None = None) -> Plan:
    """Predict one optimizer step of ``model`` trained on ``cluster`` as ``layout`` says
    (on ``gpus`` GPUs, if given: then tp × cp × pp × dp must use exactly that many)."""
    cluster = as_cluster(cluster)
    if gpus is not None and layout.gpus != gpus:
        raise ValueError(f"the layout runs on tp × cp × pp × dp = {layout.tp} × {layout.cp} "
                         f"× {layout.pp} × {layout.dp} = {layout.gpus} GPUs, not {gpus}: "
                         f"change dp (or tp, cp, pp) so that the product is {gpus}")
    check_fits(model, layout)
    if layout.fp8 and cluster.fp8_flops is None:
        raise ValueError(f"fp8=True needs FP8 tensor cores; the cluster {cluster.name!r} "
                         f"gives no fp8_flops: use an H100-class preset or fp8=False")
    schedule, order = ordered_schedule(layout.schedule, layout.pp, layout.microbatches,
                                       layout.chunks_per_rank)
    layers = chunk_layers(model, layout)
    params = chunk_parameters(model, layout, layers)
    bandwidth = data_parallel_bandwidth(cluster, layout)
    costs = with_sharded_data(chunk_costs(model, cluster, layout), cluster, layout, params,
                              bandwidth)
    costs = as_executed(costs, cluster, [schedule.rank_of(c) for c in range(schedule.stages)])
    comm = message_seconds(model, cluster, layout)
    timeline = simulate_costs(schedule, order, costs, comm)
    makespan = timeline.makespan

    rank_params = [sum(params[c] for c in schedule.stages_on(r)) for r in range(layout.pp)]
    reduction = gradient_reduction(cluster, layout, schedule, timeline, params, layers)
    optimizer = cluster.memory_seconds(
        ADAM_BYTES * max(rank_params)
        / (layout.replicas if layout.distributed_optimizer else 1))
    step = makespan + reduction + optimizer

    memory = layout_memory(model, cluster, layout, layers)
    tokens = layout.global_batch * model.seq_len
    executed = model.flops_per_token(recompute=layout.recompute == "full") * tokens
    useful = model.flops_per_token() * tokens
    return Plan(model, cluster, layout, step, memory,
                useful / (step * layout.gpus * cluster.peak_flops),
                executed / (step * layout.gpus) / 1e12, timeline,
                timeline.bubble_fraction(), makespan, reduction, optimizer,
                comm, costs)


@lru_cache(maxsize=32)
def ordered_schedule(name: str, ranks: int, microbatches: int, virtual_stages: int
                     ) -> tuple[Schedule, list[tuple[int, Action, list[Action]]]]:
    """The named schedule and its validated `execution_order`, kept for the next
    prediction of the same shape: a search or a calibration prices one shape many
    times, and for the 1T run (131,072 actions) building and ordering them takes most
    of a prediction."""
    schedule = build(name, ranks, microbatches, virtual_stages)
    return schedule, execution_order(schedule)


def simulate_costs(schedule: Schedule, order: list[tuple[int, Action, list[Action]]],
                   costs: ChunkCosts, comm: float) -> Timeline:
    """`pipeline_lib.timeline.simulate` of ``schedule`` with ``costs``, on its order
    already validated (`ordered_schedule`)."""
    cost = {"F": costs.forward, "B": costs.backward, "W": costs.weight,
            "I": [b - w for b, w in zip(costs.backward, costs.weight)]}
    with cycle_collector_paused():
        return _simulate(schedule, order, cost, comm)


def layout_memory(model: Model, cluster: Cluster, layout: Layout,
                  layers: list[int] | None = None) -> Memory:
    """The busiest GPU's bytes (`memory.busiest_memory`), with what the schedule holds
    in flight from its own order (`memory.schedule_peaks`): `predict`'s memory, and
    `search`'s for every layout it lists."""
    layers = chunk_layers(model, layout) if layers is None else layers
    sizes = activation_sizes(model, cluster, layout, layers)
    held = schedule_peaks(layout.schedule, layout.pp, layout.microbatches,
                          layout.chunks_per_rank, sizes)
    return busiest_memory(model, cluster, layout, layers, held)
