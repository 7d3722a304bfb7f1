"""`search`: every layout of a model on ``gpus`` GPUs, ranked by predicted step time.

The space: tp × cp × pp × dp = gpus; every micro-batch size up to 16 that divides a
replica's batch; each schedule, looped ones with every virtual_stages from 2 to 8 whose
chunks the layers can fill (first and last chunks may hold fewer, or none, as Llama 3's
do); the layers split as evenly as they go, and with one layer fewer on the first and
the last stage; each recompute; the data dimension replicated or sharded (ZeRO-1: the
distributed optimizer; ZeRO-2: gradients too; ZeRO-3, FSDP: weights too, freed after
the forward or kept for the backward). Sequence parallelism, with the tensor-parallel
collectives overlapped, wherever tp > 1 and it divides the sequence (it never costs
time or memory here), and every data-parallel transfer overlapped that can be.

Each layout is priced in closed form (`estimate`: the bubble of each schedule family,
the data-parallel traffic beyond what compute hides) and its memory counted exactly as
`predict` counts it (`memory.busiest_memory`, with the schedule's in-flight
activations from its order: the ranks that can hold the most, 0, 1 and p − 1); a layout
that does not fit, or cannot split the model, is rejected with its reason. The fastest
few that fit are simulated by `predict`, which has the last word on their time.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, fields
from functools import lru_cache
from numbers import Integral

import numpy as np

from pipeline_lib.plan.costs import (Pass, chunk_layers, gradient_bytes, message_seconds,
                                     passes, ring_seconds)
from pipeline_lib.plan.hardware import GiB, Cluster
from pipeline_lib.plan.memory import (Memory, busiest_memory,
                                      embedding_activation_bytes, held_windows,
                                      layer_activation_bytes)
from pipeline_lib.plan.model import RECOMPUTE, Layout, Model, check_fits, layers_per_chunk
from pipeline_lib.plan.predict import (ADAM_BYTES, Plan, as_cluster, data_parallel_bandwidth,
                                       predict)
from pipeline_lib.schedules import BUILDERS, LOOPED, V_SHAPED

SCHEDULES = ("1f1b", "interleaved_1f1b", "zb_h1")
VIRTUAL_STAGES = range(2, 9)
# The data dimension: (distributed_optimizer, shard_gradients, shard_parameters,
# reshard_after_forward), ZeRO-1 to ZeRO-3 and FSDP keeping the weights for the backward
SHARDING = ((True, False, False, True), (True, True, False, True),
            (True, True, True, True), (True, True, True, False))


@dataclass(frozen=True)
class Candidate:
    """A layout that fits, with its predicted step time and memory; ``plan`` is set for
    the finalists that were simulated, None for those priced in closed form only (their
    memory is `predict`'s all the same)."""

    layout: Layout
    step_time: float
    memory: float
    plan: Plan | None = None


@dataclass(frozen=True)
class Rejected:
    layout: Layout | None
    description: str
    reason: str


@dataclass
class SearchResult:
    ranked: list[Candidate]      # fastest first; the simulated finalists lead
    rejected: list[Rejected]

    @property
    def best(self) -> Candidate:
        if not self.ranked:
            raise ValueError("no layout fits: see .rejected for why each one fails")
        return self.ranked[0]


def differences(layout: Layout, other: Layout) -> str:
    """How ``layout`` differs from ``other``, field by field ("same layout" if not)."""
    changed = [f"{f.name} {getattr(other, f.name)} -> {getattr(layout, f.name)}"
               for f in fields(Layout) if getattr(layout, f.name) != getattr(other, f.name)]
    return ", ".join(changed) if changed else "same layout"


def divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def _positive_integer(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, Integral) or value < 1:
        raise ValueError(f"search: {name} must be a positive integer, got {value!r}"
                         + (f" (a {type(value).__name__}: pass int({value!r}))"
                            if isinstance(value, float) and value == int(value) and value >= 1
                            else ""))
    return int(value)


def _check_options(schedules, recompute, micro_batches, context_parallel) -> None:
    for name in schedules:
        if name not in BUILDERS:
            raise ValueError(f"search: unknown schedule {name!r}; choose from "
                             f"{sorted(BUILDERS)}")
    for name in recompute:
        if name not in RECOMPUTE:
            raise ValueError(f"search: recompute {name!r} is not one of {RECOMPUTE}")
    for b in micro_batches or ():
        _positive_integer("every micro-batch size (micro_batches)", b)
    for cp in context_parallel:
        _positive_integer("every context-parallel size (context_parallel)", cp)


def layouts(model: Model, gpus: int, global_batch: int, schedules: tuple[str, ...],
            recompute: tuple[str, ...], micro_batches: tuple[int, ...] | None,
            flash_attention: bool, context_parallel: tuple[int, ...] = (1,),
            fp8: bool = False):
    """Every combination of the space (see the module's docstring), as (`Layout`, its
    layers per chunk), or (`Rejected`, None) where the sizes cannot make one (with the
    reason)."""
    for tp, cp in itertools.product(divisors(gpus), context_parallel):
        if gpus % (tp * cp):
            continue
        for pp in divisors(gpus // (tp * cp)):
            dp = gpus // (tp * cp * pp)
            where = f"tp {tp} × cp {cp} × pp {pp} × dp {dp}"
            if global_batch % dp:
                yield Rejected(None, where, f"global batch {global_batch} does not split "
                               f"into {dp} equal replica batches"), None
                continue
            per_replica = global_batch // dp
            try:
                check_fits(model, Layout(tp=tp, cp=cp, pp=pp, dp=dp, global_batch=global_batch))
            except ValueError as error:
                yield Rejected(None, where, str(error)), None
                continue
            mbs = [b for b in (micro_batches or divisors(per_replica))
                   if per_replica % b == 0 and (micro_batches or b <= 16)]
            if not mbs:
                yield Rejected(None, where, f"no micro-batch size of {list(micro_batches)} "
                               f"divides a replica's {per_replica} sequences"), None
                continue
            sp = tp > 1 and model.seq_len % (tp * cp) == 0
            sharding = SHARDING if dp * cp > 1 else ((False, False, False, True),)
            for mb, name in itertools.product(mbs, schedules):
                vs = ([v for v in VIRTUAL_STAGES if pp * v <= model.layers + 2]
                      if name in LOOPED else [1])
                if name in LOOPED and pp == 1:
                    continue    # interleaving one rank: the same as 1F1B
                for v, rc, zero in itertools.product(vs, recompute, sharding):
                    if rc == "selective" and flash_attention:
                        continue    # flash attention keeps no scores: the same as "none"
                    chunks = pp * (2 if name in V_SHAPED else v)
                    ends = [(None, None)]
                    per = model.layers // chunks
                    if chunks > 2 and model.layers % chunks == 0 and per > 1:
                        ends.append((per - 1, per - 1))
                    for first, last in ends:
                        try:
                            layers = layers_per_chunk(model.layers, chunks, first, last)
                            layout = Layout(
                                tp=tp, cp=cp, pp=pp, dp=dp, micro_batch=mb,
                                global_batch=global_batch, virtual_stages=v, schedule=name,
                                recompute=rc, sequence_parallel=sp, tp_comm_overlap=sp,
                                flash_attention=flash_attention, fp8=fp8,
                                distributed_optimizer=zero[0], shard_gradients=zero[1],
                                shard_parameters=zero[2], reshard_after_forward=zero[3],
                                overlap_param_gather=zero[0],
                                first_stage_layers=first, last_stage_layers=last)
                        except ValueError as error:
                            yield Rejected(None, f"{where}, micro-batch {mb}, {name} v={v}",
                                           str(error)), None
                            continue
                        yield layout, layers


@lru_cache(maxsize=4096)
def _held(name: str, pp: int, m: int, v: int, layers: tuple[int, ...]
          ) -> tuple[tuple[int, ...], list[list[tuple[float, float]]]]:
    """The ranks that can hold the most (0, 1, p − 1: the warm-up shrinks with the rank,
    and the middle ranks hold middle chunks only; every rank of a V-shaped schedule,
    whose rank 0 also holds the last chunk) and, for each, the (layer-micro-batches,
    first-chunk micro-batches) held at its moments that no other moment beats in both."""
    which = tuple(range(pp)) if name in V_SHAPED else tuple(sorted({0, min(1, pp - 1), pp - 1}))
    first = [1.0] + [0.0] * (len(layers) - 1)
    frontiers = []
    for moments in held_windows(name, pp, m, v, [layers, first], which):
        order = np.lexsort((moments[:, 0], moments[:, 1]))      # by b, then a
        ranked = moments[order]
        last = np.append(ranked[1:, 1] != ranked[:-1, 1], True)  # each b's largest a
        frontiers.append([tuple(pair) for pair in ranked[last].tolist()])
    return which, frontiers


def search_memory(model: Model, cluster: Cluster, layout: Layout,
                  layers: list[int]) -> Memory:
    """`busiest_memory` as `predict` counts it (`predict.layout_memory`), for the ranks
    that can hold the most only: cheap enough for every layout of a search."""
    per_layer = _per_layer(model, cluster, _pass_key(layout))
    embedding = embedding_activation_bytes(model, layout)
    which, frontiers = _held(layout.schedule, layout.pp, layout.microbatches,
                             layout.chunks_per_rank, tuple(layers))
    held = [max(a * per_layer + b * embedding for a, b in f) for f in frontiers]
    return busiest_memory(model, cluster, layout, layers, held, ranks=which)


PASS_FIELDS = ("tp", "cp", "micro_batch", "recompute", "sequence_parallel",
               "tp_comm_overlap", "flash_attention", "fp8", "bytes_per_parameter")


def _pass_key(layout: Layout) -> tuple:
    """The fields a micro-batch's passes depend on: shared by the many layouts of a
    search that differ elsewhere."""
    return tuple(getattr(layout, name) for name in PASS_FIELDS)


def _pass_layout(key: tuple) -> Layout:
    fields_ = dict(zip(PASS_FIELDS, key))
    return Layout(global_batch=fields_["micro_batch"], **fields_)


@lru_cache(maxsize=4096)
def _per_layer(model: Model, cluster: Cluster, key: tuple) -> float:
    return layer_activation_bytes(model, cluster, _pass_layout(key))


@lru_cache(maxsize=4096)
def _layer_costs(model: Model, cluster: Cluster, key: tuple) -> tuple[Pass, float, Pass]:
    """`costs.passes` of the per-micro-batch fields ``key``: a block, its recompute, the
    embedding and the loss."""
    layer, recompute_seconds, first, last = passes(model, cluster, _pass_layout(key))
    return layer, recompute_seconds, first + last


def estimate(model: Model, cluster: Cluster, layout: Layout,
             layers: list[int] | None = None) -> float:
    """Closed-form step seconds of ``layout``: the busiest rank's work per micro-batch
    times m, plus the schedule's fill and drain (1F1B and GPipe: p − 1 stage steps;
    interleaved: (p − 1)/v; ZB-H1: p − 1 of F + I − W, the W filling the rest), the
    data-parallel traffic beyond what the backwards hide (per micro-batch when
    gradients are sharded), the optimizer."""
    layer, recompute, ends = _layer_costs(model, cluster, _pass_key(layout))
    layers = chunk_layers(model, layout) if layers is None else layers
    v, p, m = layout.chunks_per_rank, layout.pp, layout.microbatches
    per_stage = max(layers) * v
    work = layer * per_stage + ends
    r, e = layout.replicas, cluster.value_bytes
    bandwidth = data_parallel_bandwidth(cluster, layout)
    params = (per_stage * model.layer_parameters() + model.vocab * model.hidden) / layout.tp
    gradient = gradient_bytes(cluster, layout) * params
    forward, backward = work.forward, work.input_grad + work.weight_grad + per_stage * recompute
    regather = layout.shard_parameters and layout.reshard_after_forward
    scatter = ring_seconds(gradient, r, bandwidth, cluster.latency, 1.0)
    if regather:
        gather = ring_seconds(e * params, r, bandwidth, cluster.latency, 1.0)
        forward, backward = max(forward, gather), max(backward, gather + scatter)
    step = forward + backward
    comm = message_seconds(model, cluster, layout) if p > 1 else 0.0
    if layout.schedule == "zb_h1":
        fill = step - work.weight_grad
    elif v > 1:
        fill = step / v
    else:
        fill = step
    bubble = (p - 1) * (fill + 2 * comm * v)
    exposed = 0.0
    if layout.shard_gradients and not regather:
        exposed = max(0.0, m * scatter - m * step) + scatter / max(1, max(layers))
    elif r > 1:
        share = 1.0 if layout.distributed_optimizer else 2.0
        reduce = ring_seconds(gradient, r, bandwidth, cluster.latency, share)
        exposed = max(0.0, reduce - backward / v)
    if layout.distributed_optimizer and not (layout.shard_parameters
                                             and layout.reshard_after_forward):
        gather = ring_seconds(e * params, r, bandwidth, cluster.latency, 1.0)
        exposed += max(0.0, gather - forward / v)
    optimizer = cluster.memory_seconds(ADAM_BYTES * params
                                       / (r if layout.distributed_optimizer else 1))
    return m * step + bubble + exposed + optimizer


def search(model: Model, cluster: Cluster | str, gpus: int, global_batch: int, *,
           schedules: tuple[str, ...] = SCHEDULES, recompute: tuple[str, ...] = RECOMPUTE,
           micro_batches: tuple[int, ...] | None = None, flash_attention: bool = False,
           finalists: int = 4, context_parallel: tuple[int, ...] = (1,),
           fp8: bool = False) -> SearchResult:
    """Every layout of ``model`` on ``gpus`` GPUs at ``global_batch`` sequences per step,
    fastest first, and every rejected one with its reason. ``context_parallel``: the cp
    sizes to try; ``fp8``: FP8 Transformer layers (needs a cluster with ``fp8_flops``).
    The ``finalists`` fastest in closed form are simulated (`predict`); the rest keep
    their estimate. Every listed layout's memory is `predict`'s."""
    cluster = as_cluster(cluster)
    gpus = _positive_integer("gpus", gpus)
    global_batch = _positive_integer("global_batch", global_batch)
    _positive_integer("finalists", finalists)
    _check_options(schedules, recompute, micro_batches, context_parallel)
    if fp8 and cluster.fp8_flops is None:
        raise ValueError(f"search: fp8=True needs a cluster with fp8_flops; {cluster.name!r} "
                         f"has none")
    _layer_costs.cache_clear()
    _per_layer.cache_clear()
    fitting: list[Candidate] = []
    rejected: list[Rejected] = []
    for layout, layers in layouts(model, gpus, global_batch, tuple(schedules),
                                  tuple(recompute), micro_batches, flash_attention,
                                  tuple(context_parallel), fp8):
        if isinstance(layout, Rejected):
            rejected.append(layout)
            continue
        memory = search_memory(model, cluster, layout, layers)
        if memory > cluster.hbm_bytes:
            rejected.append(Rejected(layout, describe(layout), _too_big(memory, cluster)))
        else:
            fitting.append(Candidate(layout, estimate(model, cluster, layout, layers), memory))
    fitting.sort(key=lambda c: c.step_time)
    simulated = [Candidate(c.layout, plan.step_time, plan.memory, plan)
                 for c in fitting[:finalists]
                 for plan in [predict(model, cluster, c.layout)]]
    simulated.sort(key=lambda c: c.step_time)
    return SearchResult(simulated + fitting[finalists:], rejected)


def _too_big(memory: Memory, cluster: Cluster) -> str:
    gb = lambda x: f"{x / GiB:.1f}"
    return (f"needs {gb(memory)} GiB per GPU, more than the {gb(cluster.hbm_bytes)} GiB of "
            f"a {cluster.name} (weights {gb(memory.weights)}, gradients "
            f"{gb(memory.gradients)}, optimizer {gb(memory.optimizer)}, activations "
            f"{gb(memory.activations)}, reserved {gb(memory.reserved)})")


def describe(layout: Layout) -> str:
    """A layout in a line: its sizes, micro-batch, schedule, recompute and sharding."""
    v = f" v={layout.virtual_stages}" if layout.virtual_stages > 1 else ""
    zero = ("FSDP keeping weights" if layout.shard_parameters and not
            layout.reshard_after_forward else f"ZeRO-{layout.zero_stage}"
            if layout.zero_stage else "")
    ends = (f", first/last stage {layout.first_stage_layers}/{layout.last_stage_layers} "
            f"layers" if layout.first_stage_layers is not None else "")
    cp = f" × cp {layout.cp}" if layout.cp > 1 else ""
    return (f"tp {layout.tp}{cp} × pp {layout.pp} × dp {layout.dp}, micro-batch "
            f"{layout.micro_batch}, {layout.schedule}{v}, recompute {layout.recompute}"
            f"{', sequence parallel' if layout.sequence_parallel else ''}"
            f"{', ' + zero if zero else ''}{ends}")
