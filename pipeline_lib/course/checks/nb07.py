"""Checks of notebook 07's exercises (planning a real run).

* **7.1** (one stage's memory, by hand): the learner's ``stage_memory`` runs on the five
  layouts the notebook names (each usual slip shows in at least one: m < p, a
  micro-batch of 2, sequence parallelism, the distributed optimizer, Megatron-LM's
  18-byte convention, each recompute) and on hidden ones drawn afresh each run, with the
  planner withheld; each of the four parts is compared with the planner's count of
  stage 0, and a wrong part is matched against the usual slips so that the message says
  which one it is. Messages name the case and what is off, never the expected bytes.
* **7.2** (a layout that beats the published one): the learner's ``faster_layout`` runs
  on the two published layouts the notebook names and on a hidden one, a model and a
  cluster drawn afresh each run (a layout copied from the notebook's stored output does
  not fit it), with the planner's ``search`` withheld; the layout must use the same GPUs
  and global batch, change only the fields of `LAYOUT_LEVERS` (the kernel and optimizer
  switches stay as published), fit, and be predicted faster.

Every check raises `ExerciseFailed` with what to change; the notebook's check cell runs it
inside ``exercise("Exercise 7.N (...)")``, which prefixes the exercise's name.
"""
from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import fields, replace
from numbers import Real
from typing import Any

from pipeline_lib.course.exercises import ExerciseFailed, ignores_namespace, withheld
from pipeline_lib.plan import CLUSTERS, Cluster, Layout, Model, predict
from pipeline_lib.plan.memory import (chunk_parameters, layer_activation_bytes,
                                      schedule_peaks, state_bytes)
from pipeline_lib.plan.model import layers_per_chunk

__all__ = ["GPT3", "GPT3_LAYOUT", "STAGE_MEMORY_CASES", "check_stage_memory",
           "FASTER_LAYOUT_CASES", "LAYOUT_LEVERS", "check_faster_layout",
           "hidden_stage_memory_cases", "hidden_faster_layout_case"]

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
                  sequence_parallel=True, bytes_per_parameter=18)),
    (GPT3, Layout(tp=4, pp=32, dp=8, global_batch=1536, distributed_optimizer=True)),
    (GPT3, Layout(tp=8, pp=16, dp=64, micro_batch=2, global_batch=1536,
                  recompute="selective")),                       # m = 12 < p = 16
    (GPT39, Layout(tp=8, pp=4, dp=16, micro_batch=2, global_batch=1536, recompute="full",
                   sequence_parallel=True)),
]


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ExerciseFailed(message)


def _describe(model: Model, layout: Layout) -> str:
    return (f"{model.layers} layers of {model.hidden} ({model.heads} heads), t = {layout.tp}, "
            f"p = {layout.pp}, d = {layout.dp}, b = {layout.micro_batch}, "
            f"m = {layout.microbatches}, recompute {layout.recompute}"
            + (", sequence parallel" if layout.sequence_parallel else "")
            + (", distributed optimizer" if layout.distributed_optimizer else "")
            + f", {layout.bytes_per_parameter} bytes per parameter")


def _close(value: Any, reference: float) -> bool:
    return isinstance(value, Real) and abs(value / reference - 1) < 1e-6


def expected_stage_memory(model: Model, layout: Layout, cluster: Cluster = A100
                          ) -> dict[str, float]:
    """Stage 0's bytes as the planner counts them (`plan.memory`): its states in the
    layout's convention, and its layers' activations times the micro-batches 1F1B's
    stage 0 holds, plus, with full recompute, one layer rebuilt without it (the
    embedding's few bytes per token, which the exercise leaves out, apart)."""
    layers = layers_per_chunk(model.layers, layout.pp)
    weights, gradients, optimizer = state_bytes(chunk_parameters(model, layout, layers)[0],
                                                cluster, layout)
    per_layer = layer_activation_bytes(model, cluster, layout)
    held = schedule_peaks("1f1b", layout.pp, layout.microbatches, 1,
                          [n * per_layer for n in layers], [0])[0]
    if layout.recompute == "full":
        held += layer_activation_bytes(model, cluster, layout, "none")
    return dict(weights=weights, gradients=gradients, optimizer=optimizer, activations=held)


def hidden_stage_memory_cases(rng: random.Random, count: int = 3) -> list[tuple[Model, Layout]]:
    """GPTs and layouts drawn from ``rng``: whole layers per stage, every option of the
    exercise in play."""
    cases = []
    while len(cases) < count:
        heads = rng.choice([16, 32, 48, 64])
        hidden = heads * rng.choice([64, 128])
        tp, pp = rng.choice([1, 2, 4, 8]), rng.choice([1, 2, 4, 8])
        layers = pp * rng.randint(1, 6)
        dp = rng.choice([1, 2, 4, 16])
        micro_batch = rng.choice([1, 2, 4])
        model = Model(layers=layers, hidden=hidden, heads=heads,
                      seq_len=rng.choice([512, 1024, 2048]), vocab=rng.choice([32000, 51200]))
        layout = Layout(tp=tp, pp=pp, dp=dp, micro_batch=micro_batch,
                        global_batch=dp * micro_batch * rng.randint(1, 24),
                        recompute=rng.choice(["none", "selective", "full"]),
                        sequence_parallel=tp > 1 and rng.random() < 0.5,
                        distributed_optimizer=dp > 1 and rng.random() < 0.5,
                        bytes_per_parameter=rng.choice([16, 18]))
        if heads % tp == 0:
            cases.append((model, layout))
    return cases


def _state_slip(key: str, ratio: float, params: float, embedding: float,
                layout: Layout) -> str:
    """Which usual slip makes the learner's weights, gradients or optimizer ``ratio`` x ours."""
    if abs(ratio - (params - embedding) / params) < 1e-6:
        return " You left out the vocabulary embedding, which stage 0 holds."
    if abs(ratio - layout.tp) < 1e-6:
        return f" Divide by the {layout.tp} tensor-parallel GPUs."
    if key == "gradients":
        return (" Gradients take 2 bytes per parameter in ZeRO's 16-byte count (16-bit "
                "gradients) and 4 in Megatron-LM's 18-byte count (32-bit gradients): "
                f"this layout's bytes_per_parameter is {layout.bytes_per_parameter}.")
    if key == "optimizer":
        return (" Adam in mixed precision keeps 12 bytes per parameter (a 32-bit master copy "
                "and two 32-bit moments) in both conventions, ZeRO's 16 and Megatron-LM's "
                "18, divided over the dp replicas only with the distributed optimizer.")
    return ""


def _activation_slips(model: Model, layout: Layout, cluster: Cluster) -> list[tuple[float, str]]:
    """The usual wrong activation counts, each with what it is, for the message."""
    layer = layer_activation_bytes(model, cluster, layout)
    working = (layer_activation_bytes(model, cluster, layout, recompute="none")
               if layout.recompute == "full" else 0.0)
    in_flight = min(layout.pp, layout.microbatches)
    stage = model.layers // layout.pp * layer
    slips = [(stage + working, f"one micro-batch's worth: under 1F1B stage 0 holds more "
                               f"at its peak; count them from the schedule")]
    if in_flight < layout.microbatches:
        slips.append((layout.microbatches * stage + working,
                      f"all {layout.microbatches} micro-batches, as GPipe keeps them"))
    if in_flight < layout.pp:
        slips.append((layout.pp * stage + working,
                      f"p = {layout.pp} micro-batches, but the pipeline gets only m = "
                      f"{layout.microbatches}: stage 0 cannot hold more than there are"))
    if layout.recompute == "full":
        slips.append((in_flight * stage, "without the layer being recomputed: with full "
                      "recompute, add one layer's activations without recompute, which "
                      "it rebuilds for its backward"))
        if layout.sequence_parallel:
            slips.append((in_flight * stage * layout.tp + working,
                          "each layer's whole input: with sequence parallelism a full "
                          "recompute keeps only the GPU's s/t share of it, 2·s·b·h/t"))
    if layout.micro_batch > 1:
        slips.append(((in_flight * stage + working) / layout.micro_batch,
                      f"one sequence per micro-batch: Korthikanti et al.'s b is the "
                      f"micro-batch, {layout.micro_batch} sequences here"))
    return slips


def _how_far(mine: float, expected: float) -> str:
    """'are 20.3 GiB, about 2.0x too many': the learner's bytes against ours, or, for an
    answer in GiB or GB, that bytes are asked."""
    ratio = mine / expected
    for unit, size in (("GiB", GiB), ("GB", 1e9)):
        if abs(ratio * size - 1) < 0.01:
            return f"are in {unit}, by the look of them: the check asks for bytes"
    return (f"are {float(mine) / GiB:.3f} GiB, "
            + (f"about {ratio:.1f}x too many" if ratio > 1.05 else
               f"about {1 / ratio:.1f}x too few" if ratio < 0.95 else
               "close, but not equal (count every term)"))


@ignores_namespace(1)
def check_stage_memory(stage_memory: Callable[[Model, Layout], dict[str, float]],
                       cluster: Cluster = A100, seed: int | None = None) -> None:
    """Exercise 7.1: ``stage_memory(model, layout)`` against the planner's count of stage 0
    on `STAGE_MEMORY_CASES` and three hidden cases (drawn with ``seed``, fresh each run
    by default), with every function of the planner withheld."""
    rng = random.Random(seed)
    for model, layout in STAGE_MEMORY_CASES + hidden_stage_memory_cases(rng):
        case = _describe(model, layout)
        expected = expected_stage_memory(model, layout, cluster)
        slips = _activation_slips(model, layout, cluster)
        with withheld("pipeline_lib.plan"):
            mine = stage_memory(model, layout)
        _check(isinstance(mine, dict) and set(mine) == set(KEYS),
               f"return a dict with exactly the keys {sorted(KEYS)}, got {mine!r}")
        _check(all(isinstance(mine[key], Real) for key in KEYS),
               f"{case}: each value must be a number of bytes, got {mine!r}")
        params = chunk_parameters(model, layout, layers_per_chunk(model.layers, layout.pp))[0]
        embedding = model.vocab * model.hidden / layout.tp
        for key in KEYS[:3]:
            ratio = mine[key] / expected[key]
            _check(abs(ratio - 1) < 1e-6,
                   f"{case}: your {key}{' states' if key == 'optimizer' else ''} "
                   f"{_how_far(mine[key], expected[key])}."
                   + _state_slip(key, ratio, params, embedding, layout))
        why = "".join(f" That is {text}." for value, text in slips
                      if _close(mine["activations"], value))
        _check(_close(mine["activations"], expected["activations"]),
               f"{case}: your activations "
               f"{_how_far(mine['activations'], expected['activations'])}.{why}")


FASTER_LAYOUT_CASES: list[tuple[str, Model, Layout]] = [
    ("GPT-3 175B, Megatron-LM's script", GPT3, GPT3_LAYOUT),
    ("Narayanan et al.'s 145.6B", GPT146,
     Layout(tp=8, pp=8, dp=24, micro_batch=2, global_batch=2304,
            schedule="interleaved_1f1b", virtual_stages=2, recompute="full")),
]


# what exercise 7.2 may change; the global batch and the GPUs are fixed, and the kernel and
# optimizer switches (flash_attention, fp8, tp_comm_overlap, the distributed optimizer, ...)
# stay as published: beating a 2021 run by a kernel it did not have is no layout
LAYOUT_LEVERS = ("tp", "pp", "dp", "micro_batch", "schedule", "virtual_stages", "recompute",
                 "sequence_parallel")
_SEARCH_REASON = ("your code calls `{name}`, the planner's own search over layouts, which "
                  "does this exercise's work. Write a small search of your own (the hint's "
                  "loop) instead.")


def hidden_faster_layout_case(rng: random.Random) -> tuple[str, Model, Layout]:
    """A GPT and a layout drawn from ``rng``, as a 2021 run would have it (t 8 across
    pipeline stages, micro-batch 1, 1F1B, full recompute, few micro-batches), that a
    layout of the exercise's hint beats: the same one interleaved (v = 2), whose shorter
    fill the check makes sure of before the learner's code runs."""
    while True:
        heads = rng.choice([32, 48, 64, 80])
        stages = rng.choice([2, 4, 8])
        model = Model(layers=2 * stages * rng.randint(1, 3), hidden=heads * 128, heads=heads,
                      seq_len=2048, vocab=51200)
        dp = rng.choice([2, 4, 8])
        layout = Layout(tp=8, pp=stages, dp=dp, micro_batch=1,
                        global_batch=dp * stages * rng.choice([1, 2]), recompute="full")
        interleaved = predict(model, A100, replace(layout, virtual_stages=2,
                                                   schedule="interleaved_1f1b"))
        if interleaved.fits and interleaved.step_time < predict(model, A100, layout).step_time:
            return (f"a hidden {model.layers}-layer GPT of {model.hidden} on {layout.gpus} "
                    f"GPUs", model, layout)


@ignores_namespace(1)
def check_faster_layout(faster_layout: Callable[[Model, Cluster, Layout], Layout],
                        cluster: Cluster = A100, seed: int | None = None) -> list[str]:
    """Exercise 7.2: ``faster_layout(model, cluster, published)`` on `FASTER_LAYOUT_CASES`
    and a hidden case (drawn with ``seed``, fresh each run by default) must return a
    layout of the same GPUs and global batch that fits and is predicted faster, found
    without the planner's ``search``. Returns one line per named case."""
    lines = []
    hidden = hidden_faster_layout_case(random.Random(seed))
    for name, model, published in FASTER_LAYOUT_CASES + [hidden]:
        theirs = predict(model, cluster, published)
        try:
            with withheld("pipeline_lib.plan.search", reason=_SEARCH_REASON):
                mine = faster_layout(model, cluster, published)
        except ValueError as error:              # Layout(...) refusing a combination
            raise ExerciseFailed(f"{name}: your function stopped with ValueError: "
                                 f"{error}") from None
        _check(isinstance(mine, Layout), f"{name}: return a Layout, got {mine!r}")
        _check(mine.gpus == published.gpus,
               f"{name}: your layout uses tp x cp x pp x dp = {mine.tp} x {mine.cp} x "
               f"{mine.pp} x {mine.dp} = {mine.gpus} GPUs; the published run has "
               f"{published.gpus}")
        _check(mine.global_batch == published.global_batch,
               f"{name}: your global batch is {mine.global_batch}, the published "
               f"{published.global_batch}: it is fixed by the optimization, not the layout")
        changed = [(f.name, getattr(published, f.name), getattr(mine, f.name))
                   for f in fields(Layout) if f.name not in LAYOUT_LEVERS + ("global_batch",)
                   and getattr(mine, f.name) != getattr(published, f.name)]
        _check(not changed,
               f"{name}: your layout changes " + ", ".join(
                   f"{field} ({was!r} published, {now!r} yours)" for field, was, now in changed)
               + ": the kernel and optimizer switches stay as published; change only "
               + ", ".join(LAYOUT_LEVERS))
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
        if not name.startswith("a hidden"):
            lines.append(f"{name}: faster than published, fits")
    return lines
