"""Checks of notebook 07's exercises (planning a real run).

* **7.1** (one stage's memory, by hand): the learner's ``stage_memory`` runs on five
  layouts chosen so that each usual slip shows in at least one of them (m < p, a
  micro-batch of 2, sequence parallelism, the distributed optimizer, each recompute), with
  the whole planner withheld; each of the four parts is compared with
  ``predict(...).memory``, computed before, and a wrong part is matched against the usual
  slips so that the message can say which one it is.
* **7.2** (a layout that beats the published one): the learner's ``faster_layout`` runs on
  two published layouts with the planner's ``search`` withheld; the layout must use the
  same GPUs and global batch, fit, and be predicted faster.

Every check raises `ExerciseFailed` with what to change; the notebook's check cell runs it
inside ``exercise("Exercise 7.N (...)")``, which prefixes the exercise's name.
"""
from __future__ import annotations

from collections.abc import Callable
from numbers import Real
from typing import Any

from pipeline_lib.course.exercises import ExerciseFailed, withheld
from pipeline_lib.plan import CLUSTERS, Cluster, Layout, Model, predict
from pipeline_lib.plan.memory import layer_activation_bytes

__all__ = ["GPT3", "GPT3_LAYOUT", "STAGE_MEMORY_CASES", "check_stage_memory",
           "FASTER_LAYOUT_CASES", "check_faster_layout"]

GiB = 2**30
A100 = CLUSTERS["A100-80GB"]
KEYS = ("weights", "gradients", "optimizer", "activations")

# GPT-3 175B (Brown et al. 2020, Table 2.1) as Megatron-LM's script lays it out
GPT3 = Model(layers=96, hidden=12288, heads=96, seq_len=2048, vocab=51200)
GPT3_LAYOUT = Layout(tp=8, pp=16, dp=8, micro_batch=1, global_batch=1536, schedule="1f1b",
                     recompute="full")
# Narayanan et al. 2021, Table 1
GPT39 = Model(layers=48, hidden=8192, heads=64, seq_len=2048, vocab=51200)
GPT146 = Model(layers=80, hidden=12288, heads=96, seq_len=2048, vocab=51200)

STAGE_MEMORY_CASES: list[tuple[Model, Layout]] = [
    (GPT3, GPT3_LAYOUT),
    (GPT3, Layout(tp=8, pp=8, dp=16, global_batch=1536, recompute="selective",
                  sequence_parallel=True)),
    (GPT3, Layout(tp=4, pp=32, dp=8, global_batch=1536, distributed_optimizer=True)),
    (GPT3, Layout(tp=8, pp=16, dp=64, micro_batch=2, global_batch=1536,
                  recompute="selective")),                       # m = 12 < p = 16
    (GPT39, Layout(tp=8, pp=4, dp=16, micro_batch=2, global_batch=1536, recompute="full")),
]


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ExerciseFailed(message)


def _describe(model: Model, layout: Layout) -> str:
    return (f"{model.layers} layers of {model.hidden}, t = {layout.tp}, p = {layout.pp}, "
            f"d = {layout.dp}, b = {layout.micro_batch}, m = {layout.microbatches}, "
            f"recompute {layout.recompute}"
            + (", sequence parallel" if layout.sequence_parallel else "")
            + (", distributed optimizer" if layout.distributed_optimizer else ""))


def _close(value: Any, reference: float) -> bool:
    return isinstance(value, Real) and abs(value / reference - 1) < 1e-6


def _state_slip(key: str, ratio: float, params: float, embedding: float, tp: int) -> str:
    """Which usual slip makes the learner's weights, gradients or optimizer ``ratio`` x ours."""
    if abs(ratio - (params - embedding) / params) < 1e-6:
        return " You left out the vocabulary embedding, which stage 0 holds."
    if abs(ratio - tp) < 1e-6:
        return f" Divide by the {tp} tensor-parallel GPUs."
    if key == "optimizer":
        return (" Adam in mixed precision keeps 12 bytes per parameter (a 32-bit master copy "
                "and two 32-bit moments), divided over the dp replicas only with the "
                "distributed optimizer.")
    return ""


def _activation_slips(model: Model, cluster: Cluster, layout: Layout) -> list[tuple[float, str]]:
    """The usual wrong activation counts, each with what it is, for the message."""
    layer = layer_activation_bytes(model, cluster, layout)
    working = (layer_activation_bytes(model, cluster, layout, recompute="none")
               if layout.recompute == "full" else 0.0)
    in_flight = min(layout.pp, layout.microbatches)
    stage = model.layers // layout.pp * layer
    slips = [(stage + working, f"one micro-batch's worth: under 1F1B stage 0 holds "
                               f"{in_flight} at its peak")]
    if in_flight < layout.microbatches:
        slips.append((layout.microbatches * stage + working,
                      f"all {layout.microbatches} micro-batches, as GPipe keeps them; "
                      f"1F1B's stage 0 holds {in_flight}"))
    if in_flight < layout.pp:
        slips.append((layout.pp * stage + working,
                      f"p = {layout.pp} micro-batches, but the pipeline gets only m = "
                      f"{layout.microbatches}: stage 0 cannot hold more than there are"))
    if layout.recompute == "full":
        slips.append((in_flight * stage, "without the layer being recomputed: with full "
                      "recompute, add one layer's activations without recompute, which "
                      "it rebuilds for its backward"))
    if layout.micro_batch > 1:
        slips.append(((in_flight * stage + working) / layout.micro_batch,
                      f"one sequence per micro-batch: Korthikanti et al.'s b is the "
                      f"micro-batch, {layout.micro_batch} sequences here"))
    return slips


def check_stage_memory(stage_memory: Callable[[Model, Layout], dict[str, float]],
                       namespace: dict[str, Any] | None = None,
                       cluster: Cluster = A100) -> None:
    """Exercise 7.1: ``stage_memory(model, layout)`` against ``predict(...).memory`` on
    `STAGE_MEMORY_CASES`, with the planner withheld (``namespace``: the notebook's
    ``globals()``, where ``from pipeline_lib.plan import predict`` bound a second name)."""
    for model, layout in STAGE_MEMORY_CASES:
        case = _describe(model, layout)
        expected = predict(model, cluster, layout).memory        # before the planner is withheld
        slips = _activation_slips(model, cluster, layout)
        with withheld("pipeline_lib.plan", namespace=namespace):
            mine = stage_memory(model, layout)
        _check(isinstance(mine, dict) and set(mine) == set(KEYS),
               f"return a dict with exactly the keys {sorted(KEYS)}, got {mine!r}")
        _check(all(isinstance(mine[key], Real) for key in KEYS),
               f"{case}: each value must be a number of bytes, got {mine!r}")
        params = expected.weights / 2
        embedding = model.vocab * model.hidden / layout.tp
        for key in KEYS[:3]:
            ratio = mine[key] / getattr(expected, key)
            _check(abs(ratio - 1) < 1e-6,
                   f"{case}: your {key} are {mine[key] / GiB:.3f} GiB, the planner's "
                   f"{getattr(expected, key) / GiB:.3f} GiB ({ratio:.2f}x)."
                   + _state_slip(key, ratio, params, embedding, layout.tp))
        why = "".join(f" That is {text}." for value, text in slips
                      if _close(mine["activations"], value))
        _check(_close(mine["activations"], expected.activations),
               f"{case}: your activations are {mine['activations'] / GiB:.3f} GiB, the "
               f"planner's {expected.activations / GiB:.3f} GiB "
               f"({mine['activations'] / expected.activations:.2f}x).{why}")


FASTER_LAYOUT_CASES: list[tuple[str, Model, Layout]] = [
    ("GPT-3 175B, Megatron-LM's script", GPT3, GPT3_LAYOUT),
    ("Narayanan et al.'s 145.6B", GPT146,
     Layout(tp=8, pp=8, dp=24, micro_batch=2, global_batch=2304,
            schedule="interleaved_1f1b", virtual_stages=2, recompute="full")),
]


def check_faster_layout(faster_layout: Callable[[Model, Cluster, Layout], Layout],
                        namespace: dict[str, Any] | None = None,
                        cluster: Cluster = A100) -> list[str]:
    """Exercise 7.2: ``faster_layout(model, cluster, published)`` on `FASTER_LAYOUT_CASES`
    must return a layout of the same GPUs and global batch that fits and is predicted
    faster, found without the planner's ``search``. Returns one line per case."""
    lines = []
    for name, model, published in FASTER_LAYOUT_CASES:
        theirs = predict(model, cluster, published)
        with withheld("pipeline_lib.plan.search", namespace=namespace):
            mine = faster_layout(model, cluster, published)
        _check(isinstance(mine, Layout), f"{name}: return a Layout, got {mine!r}")
        _check(mine.gpus == published.gpus,
               f"{name}: your layout uses tp x pp x dp = {mine.tp} x {mine.pp} x {mine.dp} = "
               f"{mine.gpus} GPUs; the published run has {published.gpus}")
        _check(mine.global_batch == published.global_batch,
               f"{name}: your global batch is {mine.global_batch}, the published "
               f"{published.global_batch}: it is fixed by the optimization, not the layout")
        try:
            yours = predict(model, cluster, mine)
        except ValueError as error:
            raise ExerciseFailed(f"{name}: the planner cannot lay the model out that way: "
                                 f"{error}") from None
        _check(yours.fits,
               f"{name}: your layout needs {yours.memory / GiB:.1f} GiB on its busiest GPU, "
               f"more than the {cluster.hbm_bytes / GiB:.0f} GiB there is (weights "
               f"{yours.memory.weights / GiB:.1f}, gradients "
               f"{yours.memory.gradients / GiB:.1f}, optimizer "
               f"{yours.memory.optimizer / GiB:.1f}, activations "
               f"{yours.memory.activations / GiB:.1f} GiB): use more pipeline or "
               f"tensor-parallel GPUs, recompute, or smaller micro-batches")
        across = (" (its tensor-parallel group leaves the node)"
                  if mine.tp > cluster.gpus_per_node else "")
        _check(yours.step_time < theirs.step_time,
               f"{name}: your layout's predicted step is {yours.step_time:.2f} s{across}, "
               f"the published one's {theirs.step_time:.2f} s; it must be faster")
        lines.append(f"{name}: {yours.step_time:.2f} s against {theirs.step_time:.2f} s with "
                     f"t x p x d = {mine.tp} x {mine.pp} x {mine.dp}, micro-batch "
                     f"{mine.micro_batch}, {mine.schedule}"
                     + (f", v = {mine.virtual_stages}" if mine.virtual_stages > 1 else ""))
    return lines
