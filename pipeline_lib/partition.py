"""Choosing where to cut an ``nn.Sequential`` into pipeline stages.

A pipeline runs only as fast as its slowest stage: every micro-batch has to pass through
all of them, so the stage with the largest cost sets the beat for everyone else. Splitting
a model therefore means choosing a *balance* -- how many consecutive layers each stage
gets, e.g. ``[3, 1, 2]`` -- that makes the largest stage cost as small as possible.

The module keeps the two halves of that job apart:

* *measuring* a cost per top-level layer: `layer_params`, `layer_times`, `layer_memory`;
* *splitting* a list of costs: `optimal_split`, with `stage_costs` to show what a
  balance costs per stage.

The ``balance_by_*`` functions just chain the two. Keeping them separate lets a notebook
print the per-layer costs, the chosen balance and the per-stage costs side by side, and
lets you plug in a cost you measured yourself. Finally `group_layers` cuts the model by a
balance; both executors call it, and `check_balance` is the one check of a balance.
"""
from __future__ import annotations

import copy
import math
import numbers
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from itertools import accumulate
from typing import Any

import torch
from torch import Tensor, nn

from pipeline_lib import tree
from pipeline_lib.memory import SavedActivations

__all__ = ["optimal_split", "stage_costs", "check_balance", "group_layers", "layer_params",
           "layer_times", "layer_memory", "balance_by_params", "balance_by_time",
           "balance_by_memory"]

#: What flows between layers: a tensor, or tuples, lists and dicts holding tensors
#: (other items pass through untouched).
Activations = Any
#: ``loss_fn(output, target)``: the last stage's loss, a scalar tensor (as in `Pipe.step`).
LossFn = Callable[[Activations, Activations], Tensor]


# --------------------------------------------------------------------------- splitting


def optimal_split(costs: Sequence[float], stages: int) -> list[int]:
    """Return the balance that minimises the largest stage cost.

    A stage's cost is the sum of its layers' costs; every stage gets at least one layer.
    A dynamic program, O(stages * layers^2): instantaneous for the tens to hundreds of
    layers a pipeline is cut from. Sums are plain floats: where exact sums tie (whole
    numbers such as parameter counts, zero-cost layers) float sums tie too, and splits
    that differ only by rounding cannot matter for timings noisy in their second digit.

    Ties: many balances often reach the same optimum (a zero-cost ``nn.ReLU`` under
    `balance_by_params` can sit on either side of a cut). We return the lexicographically
    smallest: each stage, from the first on, takes as few layers as it can, because under
    1F1B-style schedules the early stages hold the most in-flight micro-batches.
    """
    _check_costs(costs)
    layers = len(costs)
    _check_stages(stages, layers)
    prefix = list(accumulate(costs, initial=0))

    def cost(start: int, end: int) -> float:
        return prefix[end] - prefix[start]

    # best[s][i]: the smallest largest stage when layers i.. are split into s stages.
    # One stage takes all that is left; of s stages, the first ends at some `end` that
    # leaves a layer for each of the other s - 1, and they cost best[s - 1][end].
    best: dict[int, list[float]] = {1: [cost(i, layers) for i in range(layers + 1)]}
    for s in range(2, stages + 1):
        best[s] = [min((max(cost(i, end), best[s - 1][end])
                        for end in range(i + 1, layers - s + 2)), default=math.inf)
                   for i in range(layers + 1)]

    # Walk forward, letting each stage end at the first cut that still allows the
    # optimum. Any optimal balance satisfies both conditions at its own cut, so the
    # first such cut gives the lexicographically smallest optimal balance.
    bottleneck = best[stages][0]
    cuts = [0]
    for s in range(stages, 1, -1):
        cuts.append(next(end for end in range(cuts[-1] + 1, layers - s + 2)
                         if cost(cuts[-1], end) <= bottleneck
                         and best[s - 1][end] <= bottleneck))
    cuts.append(layers)
    return [end - start for start, end in zip(cuts, cuts[1:])]


def stage_costs(costs: Sequence[float], balance: Sequence[int]) -> list[float]:
    """Total cost of each stage of ``balance``, to see how even a split came out.

    Sums use `math.fsum`, so the numbers do not depend on summation order.
    """
    _check_costs(costs)
    return [math.fsum(costs[a:b]) for a, b in _spans(check_balance(balance, len(costs)))]


def check_balance(balance: Sequence[int], layers: int) -> list[int]:
    """``balance`` as a list of Python ints, once it is known to cut ``layers`` layers
    into stages of at least one layer each.

    Any `numbers.Integral` counts (numpy's integers too); a bool or a float is refused as
    a likely mistake. A whole array or tensor is refused rather than converted, because
    the executors also use the balance as given (an array's truth value is ambiguous).
    """
    if not isinstance(balance, (list, tuple)):
        raise TypeError(f"balance must be a list of layer counts, one per stage, got "
                        f"{type(balance).__name__}; e.g. balance=[3, 2], or "
                        f"balance.tolist() for an array")
    for k, count in enumerate(balance):
        if isinstance(count, bool) or not isinstance(count, numbers.Integral):
            raise TypeError(f"balance[{k}] is {count!r} ({type(count).__name__}): layer "
                            f"counts must be ints, e.g. balance=[3, 2] (.tolist() converts "
                            f"an array or a tensor)")
    counts = [int(count) for count in balance]
    if any(count < 1 for count in counts):
        raise ValueError(f"balance {counts} has a stage of {min(counts)} layers: every "
                         f"stage needs at least 1")
    if sum(counts) != layers:
        raise ValueError(f"balance {counts} sums to {sum(counts)} but the module has "
                         f"{layers} layers; the counts must add up to the number of layers "
                         f"(pipeline_lib.partition.balance_by_time and friends compute one)")
    return counts


def _spans(balance: list[int]) -> Iterator[tuple[int, int]]:
    """``(first layer, last layer + 1)`` of each stage."""
    bounds = list(accumulate(balance, initial=0))
    return zip(bounds, bounds[1:])


def _check_costs(costs: Sequence[float]) -> None:
    if len(costs) == 0:
        raise ValueError("costs is empty: give one cost per layer, at least one layer")
    for i, c in enumerate(costs):
        if not math.isfinite(c):
            raise ValueError(f"costs[{i}] is {c}: every cost must be a finite number")
        if c < 0:
            raise ValueError(f"costs[{i}] is {c}: costs must be non-negative (a layer "
                             f"cannot make its stage cheaper)")


def _check_stages(stages: int, layers: int) -> None:
    if not isinstance(stages, numbers.Integral) or isinstance(stages, bool):
        raise TypeError(f"stages must be an int, got {stages!r}")
    if stages < 1:
        raise ValueError(f"stages must be at least 1, got {stages}")
    if stages > layers:
        raise ValueError(f"cannot split {layers} layers into {stages} stages: every stage "
                         f"needs at least one layer. Use stages <= {layers}, or split big "
                         f"layers into several children of the nn.Sequential")


# --------------------------------------------------------------------------- cutting


def group_layers(module: nn.Sequential, balance: Sequence[int] | None) -> list[nn.Module]:
    """Stages from consecutive layers: ``balance[k]`` layers in stage k, or one layer each.

    Both executors cut the model here, so what makes a cut well defined is checked here:
    a valid balance, and no module listed twice (see `_check_sequential`).
    """
    _check_sequential(module, "a pipeline")
    layers = list(module)
    if balance is None:
        return layers
    return [nn.Sequential(*layers[a:b]) for a, b in _spans(check_balance(balance, len(layers)))]


# --------------------------------------------------------------------------- measuring


def layer_params(module: nn.Sequential) -> list[int]:
    """Number of parameters of each top-level layer.

    A parameter shared by several layers (tied embeddings) is counted once, at the first
    layer that uses it: it exists once in memory, and counting it twice would make the
    model look heavier than it is. Mind that if a split puts its users on different
    stages, a real pipeline needs a copy on each.
    """
    _check_sequential(module, "layer_params")
    return [sum(p.numel() for p in fresh) for fresh in _new_parameters(module)]


def layer_times(module: nn.Sequential, sample: Activations, *, repeats: int = 5,
                device: torch.device | str | None = None, loss_fn: LossFn | None = None,
                target: Activations = None) -> list[float]:
    """Seconds each top-level layer takes for one forward plus backward on ``sample``,
    which should be one micro-batch: that is what a stage processes.

    With ``loss_fn`` (and the micro-batch's ``target``), the last layer's time includes
    ``loss_fn(output, target)`` and its backward, as the last stage of `Pipe.step` runs
    them. Leave it out and a costly loss (a language model's cross-entropy over the whole
    vocabulary) goes uncounted, so the last stage measures slower than predicted.

    The sample runs through the layers in order, each getting the previous output
    *detached* (a fresh leaf, requiring grad if the original did), so backward stops at
    the layer's boundary; it is seeded with ones (its cost does not depend on values).
    That is a stage's job exactly, so per-layer times add up to a stage's time.

    One warm-up run (first calls allocate and pick kernels), then the median of
    ``repeats`` runs, which ignores the odd run slowed by something else on the machine.
    CUDA is synchronised around each run, or we would time kernel launches only.
    Layers run on a training-mode copy (see `_profiling_copies`) on ``device``, by
    default the sample's.
    """
    _check_sequential(module, "layer_times")
    if not isinstance(repeats, numbers.Integral) or repeats < 1:
        raise ValueError(f"repeats must be an int of at least 1, got {repeats!r}")
    if (loss_fn is None) != (target is None):
        raise ValueError("give loss_fn and target together (the loss of the last layer's "
                         "output against the micro-batch's target), or neither")
    x, device = _first_input(sample, device)
    if target is not None:
        target = tree.map_tensors(lambda t: t.to(device), target)
    last = len(module) - 1
    times = []
    for k, layer in enumerate(_profiling_copies(module, device)):
        loss = (lambda y: loss_fn(y, target)) if loss_fn is not None and k == last else None
        runs = []
        for _ in range(1 + repeats):
            _synchronize(device)
            start = time.perf_counter()
            y = _forward_backward(layer, x, loss)
            _synchronize(device)
            runs.append(time.perf_counter() - start)
            layer.zero_grad(set_to_none=True)  # so every run writes fresh gradients
            for t in _tensors(x, "a layer's input"):
                t.grad = None
        times.append(statistics.median(runs[1:]))
        x = _detached(y)
    return times


def layer_memory(module: nn.Sequential, sample: Activations, *,
                 device: torch.device | str | None = None) -> list[int]:
    """Bytes each top-level layer holds during training on ``sample`` (one micro-batch:
    activation memory grows with the batch). Run as in `layer_times`. Per layer:

    * activations: what autograd saves in the forward for the backward, counted by
      `pipeline_lib.memory.SavedActivations` on any device: a tensor saved twice
      (``x * x``) counts once; saved parameters and buffers are not activations;
    * parameters: their bytes, doubled if they require grad (the gradient is as big).
      Shared parameters count once, as in `layer_params`.

    Not counted: optimizer state, temporaries freed within forward, and the output
    unless a later layer saves it (and is charged). A tensor saved by two adjacent
    layers (a ReLU output feeding a Linear) is charged to both: if a cut falls between
    them, both stages really do hold it.
    """
    _check_sequential(module, "layer_memory")
    x, device = _first_input(sample, device)
    activations = []
    for layer in _profiling_copies(module, device):
        with torch.enable_grad(), SavedActivations([layer]) as saved:
            x = _detached(layer(x))
        activations.append(saved.peak[0])
    params = [sum(p.numel() * p.element_size() * (2 if p.requires_grad else 1) for p in fresh)
              for fresh in _new_parameters(module)]
    return [a + p for a, p in zip(activations, params)]


def _new_parameters(module: nn.Sequential) -> list[list[nn.Parameter]]:
    """Each layer's parameters that no earlier layer has, so a shared one is charged once."""
    seen: set[int] = set()
    per_layer = []
    for layer in module:
        fresh = [p for p in layer.parameters() if id(p) not in seen]
        seen.update(id(p) for p in fresh)
        per_layer.append(fresh)
    return per_layer


# --------------------------------------------------------------------------- balancing


def balance_by_params(module: nn.Sequential, stages: int) -> list[int]:
    """Balance that evens out the parameter count per stage (see `layer_params`).

    Cheap and needs no sample, but blind to compute: a convolution with few weights may
    be the slowest layer. Use it to even out weight memory.
    """
    return optimal_split(layer_params(module), stages)


def balance_by_time(module: nn.Sequential, sample: Activations, stages: int, *,
                    repeats: int = 5, device: torch.device | str | None = None,
                    loss_fn: LossFn | None = None, target: Activations = None) -> list[int]:
    """Balance that evens out forward+backward time per stage (see `layer_times`; pass
    ``loss_fn`` and ``target`` when the loss is costly, so the last stage carries it).

    Time is what a pipeline's throughput depends on, so this is usually the one to use;
    measure on the hardware you will train on.
    """
    _check_sequential(module, "balance_by_time")
    _check_stages(stages, len(module))
    return optimal_split(layer_times(module, sample, repeats=repeats, device=device,
                                     loss_fn=loss_fn, target=target), stages)


def balance_by_memory(module: nn.Sequential, sample: Activations, stages: int, *,
                      device: torch.device | str | None = None) -> list[int]:
    """Balance that evens out training memory per stage (see `layer_memory`).

    Use it when the model barely fits and the largest stage must fit on one device.
    """
    _check_sequential(module, "balance_by_memory")
    _check_stages(stages, len(module))
    return optimal_split(layer_memory(module, sample, device=device), stages)


# --------------------------------------------------------------------------- helpers


def _check_sequential(module: nn.Module, caller: str) -> None:
    """The model is a non-empty ``nn.Sequential`` that lists every module once.

    A module listed twice (``nn.Sequential(lin, lin)``) would be one set of weights in
    two layers, so in two stages that run at the same time; and ``module.children()``
    yields it only once, so a cut by children would silently drop the repeat.
    """
    if not isinstance(module, nn.Sequential):
        raise TypeError(
            f"{caller} needs an nn.Sequential, whose top-level layers are the units a "
            f"pipeline can cut between; got {type(module).__name__}. If its forward just "
            "calls its children in order, use nn.Sequential(*model.children()); "
            "otherwise list the blocks yourself: nn.Sequential(embed, *blocks, head)"
        )
    if len(module) == 0:
        raise ValueError(f"{caller} got an empty nn.Sequential: there is nothing to split")
    first_index: dict[int, int] = {}
    for i, layer in enumerate(module):
        first = first_index.setdefault(id(layer), i)
        if first != i:
            raise ValueError(
                f"layers {first} and {i} of the nn.Sequential are the same "
                f"{type(layer).__name__} object, but a pipeline cuts between layers and "
                f"each stage owns its own. For a second, independent layer use "
                f"copy.deepcopy(layer); to apply the same layer twice, make the repeats "
                f"one layer, e.g. nn.Sequential(layer, layer) as a single entry"
            )


def _profiling_copies(module: nn.Sequential, device: torch.device) -> Iterator[nn.Module]:
    """A training-mode copy of each layer on ``device``, one at a time: the given module
    (gradients, BatchNorm statistics, device) is untouched, for one layer's extra memory."""
    for layer in module:
        yield copy.deepcopy(layer).to(device).train()


def _forward_backward(layer: nn.Module, x: Activations,
                      loss: Callable[[Activations], Tensor] | None = None) -> Activations:
    y = layer(x)
    if loss is not None:
        loss(y).backward()
        return y
    outputs = [t for t in _tensors(y, "each layer's output") if t.requires_grad]
    if outputs:
        torch.autograd.backward(outputs, [torch.ones_like(t) for t in outputs])
    return y


def _tensors(value: Activations, what: str) -> list[Tensor]:
    tensors = tree.tensors(value)
    if not tensors:
        raise TypeError(f"{what} holds no tensor: it must be a Tensor, or tuples, lists or "
                        f"dicts of them; got {type(value).__name__}")
    return tensors


def _detached(value: Activations) -> Activations:
    """The next layer's input: same data, but a fresh leaf so backward stops here."""
    return tree.map_tensors(lambda t: t.detach().requires_grad_(t.requires_grad), value)


def _first_input(sample: Activations, device: torch.device | str | None
                 ) -> tuple[Activations, torch.device]:
    """The first layer's input on the profiling device (by default the sample's own),
    detached like every other layer's input, so the caller's ``sample.grad`` is untouched."""
    first = _tensors(sample, "sample")[0]
    device = torch.device(device) if device is not None else first.device
    return _detached(tree.map_tensors(lambda t: t.to(device), sample)), device


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
