"""`search`: every layout of a model on ``gpus`` GPUs, ranked by predicted step time.

Tens of thousands of layouts are priced in closed form (the bubble of each schedule
family, the data-parallel reduction behind one backward, the in-flight activations of
the first rank); only the fastest few that fit are simulated by `predict`, which has the
last word on their time and memory.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, fields
from functools import lru_cache

from pipeline_lib.plan.costs import Pass, message_seconds, passes, ring_seconds
from pipeline_lib.plan.hardware import GiB, Cluster
from pipeline_lib.plan.memory import layer_activation_bytes, logits_bytes, state_bytes
from pipeline_lib.plan.model import RECOMPUTE, Layout, Model, check_fits, layers_per_chunk
from pipeline_lib.plan.predict import (ADAM_BYTES, Plan, as_cluster, data_parallel_bandwidth,
                                       predict)
from pipeline_lib.schedules import rounds

SCHEDULES = ("1f1b", "interleaved_1f1b", "zb_h1")


@dataclass(frozen=True)
class Candidate:
    """A layout that fits, with its predicted step time and memory; ``plan`` is set for
    the finalists that were simulated, None for those priced in closed form only."""

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


def layouts(model: Model, gpus: int, global_batch: int, schedules: tuple[str, ...],
            recompute: tuple[str, ...], micro_batches: tuple[int, ...] | None,
            flash_attention: bool) -> list[Layout | Rejected]:
    """Every combination: tp × pp × dp = gpus, each micro-batch size up to 16 dividing the
    batch of a replica, each schedule (looped ones with every virtual_stages from 2 to 8
    that splits a stage's layers evenly; with one pipeline rank they are 1F1B, so left
    out), recompute, sequence parallelism (tp > 1), distributed optimizer (dp > 1).
    Sharded gradients (ZeRO stage 2) are left out: their reduce-scatter after every
    micro-batch's backward, when micro-batches accumulate, is not priced, so the search
    would take the memory they save for free."""
    out: list[Layout | Rejected] = []
    for tp in divisors(gpus):
        for pp in divisors(gpus // tp):
            dp = gpus // (tp * pp)
            where = f"tp {tp} × pp {pp} × dp {dp}"
            if global_batch % dp:
                out.append(Rejected(None, where, f"global batch {global_batch} does not split "
                                    f"into {dp} equal replica batches"))
                continue
            mbs = [b for b in (micro_batches or divisors(global_batch // dp)) if b <= 16
                   and (global_batch // dp) % b == 0]
            try:
                check_fits(model, Layout(tp=tp, pp=pp, dp=dp, global_batch=global_batch))
            except ValueError as error:
                out.append(Rejected(None, where, str(error)))
                continue
            for mb, name, rc, sp, do in itertools.product(
                    mbs, schedules, recompute, (False, True) if tp > 1 else (False,),
                    (False, True) if dp > 1 else (False,)):
                looped = name.startswith("interleaved") or name == "looped_bfs"
                vs = [v for v in range(2, 9) if model.layers % (pp * v) == 0] \
                    if looped else [1]
                if looped and (pp == 1 or not vs):
                    continue    # interleaving one rank, or no even split: same as 1F1B
                for v in vs:
                    out.append(Layout(tp=tp, pp=pp, dp=dp, micro_batch=mb,
                                      global_batch=global_batch, virtual_stages=v,
                                      schedule=name, recompute=rc, sequence_parallel=sp,
                                      distributed_optimizer=do,
                                      flash_attention=flash_attention))
    return out


def estimate(model: Model, cluster: Cluster, layout: Layout) -> tuple[float, float]:
    """Closed-form (step seconds, bytes on the first rank) of ``layout``: each rank's
    work per micro-batch times m, plus the schedule's fill and drain (1F1B and GPipe:
    p − 1 stage steps; interleaved: (p − 1)/v; ZB-H1: p − 1 of F + I − W, the W
    filling the rest), the data-parallel reduction beyond one backward, the optimizer."""
    # the embedding and the loss as if one rank held both: an upper bound
    layer, recompute, ends = _layer_costs(model, cluster, layout.tp, layout.micro_batch,
                                          layout.recompute, layout.sequence_parallel,
                                          layout.flash_attention)
    counts = layers_per_chunk(model.layers, layout.chunks)
    v, p, m = layout.chunks_per_rank, layout.pp, layout.microbatches
    per_stage = max(counts) * v
    work = layer * per_stage + ends
    step = work.forward + work.input_grad + work.weight_grad + per_stage * recompute
    comm = message_seconds(model, cluster, layout) if p > 1 else 0.0
    if layout.schedule == "zb_h1":
        fill = work.forward + work.input_grad - work.weight_grad + per_stage * recompute
    elif layout.chunks_per_rank > 1:
        fill = step / v
    else:
        fill = step
    bubble = (p - 1) * (fill + 2 * comm * v)
    params = (per_stage * model.layer_parameters() + model.vocab * model.hidden) / layout.tp
    e, d = cluster.value_bytes, layout.dp
    bandwidth = data_parallel_bandwidth(cluster, layout)
    share = 1.0 if layout.distributed_optimizer else 2.0
    reduce = ring_seconds(e * params, d, bandwidth, cluster.latency, share)
    exposed = max(0.0, reduce - (work.input_grad + work.weight_grad) / v)
    if layout.distributed_optimizer:
        exposed += ring_seconds(e * params, d, bandwidth, cluster.latency, 1.0)
    optimizer = cluster.memory_seconds(ADAM_BYTES * params
                                       / (d if layout.distributed_optimizer else 1))
    seconds = m * step + bubble + exposed + optimizer
    if layout.schedule == "gpipe":
        held = m
    elif v > 1:
        g = len(rounds(p, m)[0])
        held = min(m * v, (v - 1) * g + 2 * (p - 1) + 1) / v
    else:
        held = min(p, m)
    per_layer = layer_activation_bytes(model, cluster, layout)
    working = layer_activation_bytes(model, cluster, layout, "none") \
        if layout.recompute == "full" else 0.0
    activations = held * per_stage * per_layer + working + (logits_bytes(model, layout)
                                                            if p == 1 else 0.0)
    return seconds, sum(state_bytes(params, cluster, layout)) + activations


@lru_cache(maxsize=4096)
def _layer_costs(model: Model, cluster: Cluster, tp: int, micro_batch: int, recompute: str,
                 sequence_parallel: bool, flash_attention: bool) -> tuple[Pass, float, Pass]:
    """`layer_pass` and the embedding and loss passes, which depend on these fields only:
    computed once for the many layouts that share them."""
    layout = Layout(tp=tp, micro_batch=micro_batch, global_batch=micro_batch,
                    recompute=recompute, sequence_parallel=sequence_parallel,
                    flash_attention=flash_attention)
    layer, recompute_seconds, first, last = passes(model, cluster, layout)
    return layer, recompute_seconds, first + last


def search(model: Model, cluster: Cluster | str, gpus: int, global_batch: int, *,
           schedules: tuple[str, ...] = SCHEDULES, recompute: tuple[str, ...] = RECOMPUTE,
           micro_batches: tuple[int, ...] | None = None, flash_attention: bool = False,
           finalists: int = 4) -> SearchResult:
    """Every valid layout of ``model`` on ``gpus`` GPUs at ``global_batch`` sequences per
    step, fastest first, and every rejected one with its reason. The ``finalists``
    fastest in closed form are simulated (`predict`); the rest keep their estimate."""
    cluster = as_cluster(cluster)
    if gpus < 1 or global_batch < 1:
        raise ValueError(f"need gpus >= 1 and global_batch >= 1, got {gpus}, {global_batch}")
    _layer_costs.cache_clear()
    fitting: list[Candidate] = []
    rejected: list[Rejected] = []
    for layout in layouts(model, gpus, global_batch, schedules, recompute, micro_batches,
                          flash_attention):
        if isinstance(layout, Rejected):
            rejected.append(layout)
            continue
        seconds, nbytes = estimate(model, cluster, layout)
        if nbytes > cluster.hbm_bytes:
            rejected.append(Rejected(layout, _describe(layout), f"needs about "
                                     f"{nbytes / GiB:.0f} GiB per GPU, more than the "
                                     f"{cluster.hbm_bytes / GiB:.0f} GiB of a {cluster.name}"))
        else:
            fitting.append(Candidate(layout, seconds, nbytes))
    fitting.sort(key=lambda c: c.step_time)
    simulated: list[Candidate] = []
    rest = iter(fitting)
    for candidate in rest:
        plan = predict(model, cluster, candidate.layout)
        if not plan.fits:
            rejected.append(Rejected(candidate.layout, _describe(candidate.layout),
                                     f"simulated: needs {plan.memory / GiB:.0f} GiB per GPU, "
                                     f"more than {cluster.hbm_bytes / GiB:.0f} GiB"))
            continue
        simulated.append(Candidate(candidate.layout, plan.step_time, plan.memory, plan))
        if len(simulated) == finalists:
            break
    simulated.sort(key=lambda c: c.step_time)
    return SearchResult(simulated + list(rest), rejected)


def _describe(layout: Layout) -> str:
    v = f" v={layout.virtual_stages}" if layout.virtual_stages > 1 else ""
    return (f"tp {layout.tp} × pp {layout.pp} × dp {layout.dp}, micro-batch "
            f"{layout.micro_batch}, {layout.schedule}{v}, recompute {layout.recompute}"
            f"{', sequence parallel' if layout.sequence_parallel else ''}"
            f"{', distributed optimizer' if layout.distributed_optimizer else ''}")
