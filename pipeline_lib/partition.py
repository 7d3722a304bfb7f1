"""Choosing where to cut an ``nn.Sequential`` into pipeline stages.

A pipeline runs only as fast as its slowest stage: every micro-batch has to pass through
all of them, so the stage with the largest cost sets the beat for everyone else. Splitting
a model therefore means choosing a *balance* -- how many consecutive layers each stage
gets, e.g. ``[3, 1, 2]`` -- that makes the largest stage cost as small as possible.

The module keeps the two halves of that job apart:

* *measuring* a cost per top-level layer: `layer_params`, `layer_times`, `layer_memory`;
* *splitting* a list of costs: `optimal_split` (exact), with `stage_costs` to show what
  a balance costs per stage.

The ``balance_by_*`` functions just chain the two. Keeping them separate lets a notebook
print the per-layer costs, the chosen balance and the per-stage costs side by side, and
lets you plug in a cost you measured yourself.
"""
from __future__ import annotations

import copy
import math
import numbers
import statistics
import time
from collections.abc import Iterator, Sequence
from fractions import Fraction
from itertools import accumulate
from typing import Union

import torch
from torch import Tensor, nn

__all__ = [
    "optimal_split",
    "stage_costs",
    "layer_params",
    "layer_times",
    "layer_memory",
    "balance_by_params",
    "balance_by_time",
    "balance_by_memory",
]

#: What flows between layers: a tensor, or a tuple of them (non-tensor items pass through).
Activations = Union[Tensor, tuple]


# --------------------------------------------------------------------------- splitting


def optimal_split(costs: Sequence[float], stages: int) -> list[int]:
    """Return the balance that minimises the largest stage cost.

    A stage's cost is the sum of its layers' costs; every stage gets at least one layer.

    The answer is exact, not approximately optimal: the costs are turned into integers
    without rounding (every float is a fraction whose denominator is a power of two, so
    scaling by the common denominator is lossless), and a dynamic program over those
    integers compares sums exactly. Two splits that tie really do tie, rather than
    differing in the last bit depending on the order the floats were added in.

    Tie-breaking: many balances often reach the same optimum (zero-cost layers such as
    ``nn.ReLU`` under `balance_by_params` can sit on either side of a cut). We return the
    lexicographically smallest one, i.e. each stage, from the first on, takes as few
    layers as it can. The reason: under 1F1B-style schedules the early stages keep the
    activations of the most in-flight micro-batches, so when the bottleneck does not care,
    leaving early stages lighter is the better default.

    Runs in O(stages * layers^2), instantaneous for the tens to hundreds of layers a
    pipeline is cut from.
    """
    weights = _exact_integers(costs)
    layers = len(weights)
    _check_stages(stages, layers)

    prefix = list(accumulate(weights, initial=0))

    def segment(start: int, end: int) -> int:
        return prefix[end] - prefix[start]

    # best[s][i]: the smallest achievable bottleneck when layers i.. are split into s
    # stages. One stage simply takes everything that is left.
    best: dict[int, list[float]] = {1: [segment(i, layers) for i in range(layers + 1)]}
    for s in range(2, stages + 1):
        best[s] = [math.inf] * (layers + 1)
        # The first of the s stages is [i, end); the other s - 1 stages need a layer
        # each, hence end <= layers - (s - 1).
        for i in range(layers - s + 1):
            best[s][i] = min(
                max(segment(i, end), best[s - 1][end])
                for end in range(i + 1, layers - s + 2)
            )

    # Walk forward, letting each stage end at the first cut that still allows the
    # optimum. Any optimal balance satisfies both conditions at its own cut, so the
    # first such cut gives the lexicographically smallest optimal balance.
    bottleneck = best[stages][0]
    balance: list[int] = []
    start = 0
    for s in range(stages, 1, -1):
        end = next(
            end
            for end in range(start + 1, layers - s + 2)
            if segment(start, end) <= bottleneck and best[s - 1][end] <= bottleneck
        )
        balance.append(end - start)
        start = end
    balance.append(layers - start)
    return balance


def stage_costs(costs: Sequence[float], balance: Sequence[int]) -> list[float]:
    """Total cost of each stage of ``balance``, to see how even a split came out.

    Sums use `math.fsum`, so the numbers do not depend on summation order.
    """
    _check_costs(costs)
    if any(not isinstance(n, numbers.Integral) or n < 1 for n in balance):
        raise ValueError(
            f"balance {list(balance)} is invalid: every stage needs a whole number "
            "of layers, at least 1"
        )
    if sum(balance) != len(costs):
        raise ValueError(
            f"balance {list(balance)} covers {sum(balance)} layers but there are "
            f"{len(costs)} costs: the layer counts must add up to the number of layers"
        )
    bounds = list(accumulate(balance, initial=0))
    return [math.fsum(costs[a:b]) for a, b in zip(bounds, bounds[1:])]


def _check_costs(costs: Sequence[float]) -> None:
    if len(costs) == 0:
        raise ValueError("costs is empty: give one cost per layer, at least one layer")
    for i, c in enumerate(costs):
        if not math.isfinite(c):
            raise ValueError(f"costs[{i}] is {c}: every cost must be a finite number")
        if c < 0:
            raise ValueError(
                f"costs[{i}] is {c}: costs must be non-negative (a layer cannot make "
                "its stage cheaper)"
            )


def _exact_integers(costs: Sequence[float]) -> list[int]:
    """Scale the costs to integers with the same ratios, losslessly."""
    _check_costs(costs)
    fractions = [
        Fraction(int(c)) if isinstance(c, numbers.Integral) else Fraction(float(c))
        for c in costs
    ]
    scale = math.lcm(*(f.denominator for f in fractions))
    return [int(f * scale) for f in fractions]


def _check_stages(stages: int, layers: int) -> None:
    if not isinstance(stages, numbers.Integral) or isinstance(stages, bool):
        raise TypeError(f"stages must be an int, got {stages!r}")
    if stages < 1:
        raise ValueError(f"stages must be at least 1, got {stages}")
    if stages > layers:
        raise ValueError(
            f"cannot split {layers} layers into {stages} stages: every stage needs at "
            f"least one layer. Use stages <= {layers}, or split big layers into "
            "several children of the nn.Sequential"
        )


# --------------------------------------------------------------------------- measuring


def layer_params(module: nn.Sequential) -> list[int]:
    """Number of parameters of each top-level layer.

    A parameter shared by several layers (tied embeddings, or the same module listed
    twice) is counted once, at the first layer that uses it: it exists once in memory,
    and counting it twice would make the model look heavier than it is. Mind that if a
    split puts its users on different stages, a real pipeline needs a copy on each.
    """
    _check_sequential(module, "layer_params")
    seen: set[int] = set()
    counts = []
    for layer in module:
        fresh = [p for p in layer.parameters() if id(p) not in seen]
        seen.update(id(p) for p in fresh)
        counts.append(sum(p.numel() for p in fresh))
    return counts


def layer_times(
    module: nn.Sequential,
    sample: Activations,
    *,
    repeats: int = 5,
    device: torch.device | str | None = None,
) -> list[float]:
    """Seconds each top-level layer takes for one forward plus backward on ``sample``.

    ``sample`` should be one micro-batch, since that is what a stage will process.

    How it is measured: the sample runs through the layers in order, each layer getting
    the previous layer's output. Each layer receives that output *detached* -- a fresh
    leaf that still requires grad if the original did -- so that backward stops at the
    layer's boundary. Backward is seeded with a ones-like gradient (its cost does not
    depend on the values). That is exactly a pipeline stage's job: receive an
    activation, compute, receive a gradient, compute the parameter gradients and the
    gradient to send upstream. Per-layer times measured this way add up, so a stage
    costs the sum of its layers.

    Each layer runs once as a warm-up (first calls pay for allocation and kernel
    selection), then ``repeats`` timed runs whose median is kept, because the median
    ignores the odd run slowed down by something else on the machine. On CUDA the device
    is synchronised around each run; otherwise we would time the kernel launches only.

    Layers are profiled on a copy in training mode, so the given module (its gradients,
    BatchNorm statistics, device) is left untouched. ``device`` defaults to the device
    of ``sample``.
    """
    _check_sequential(module, "layer_times")
    if not isinstance(repeats, numbers.Integral) or repeats < 1:
        raise ValueError(f"repeats must be an int of at least 1, got {repeats!r}")
    x, device = _first_input(sample, device)
    times = []
    for layer in _profiling_copies(module, device):
        runs = []
        for _ in range(1 + repeats):
            _synchronize(device)
            start = time.perf_counter()
            y = _forward_backward(layer, x)
            _synchronize(device)
            runs.append(time.perf_counter() - start)
            _clear_grads(layer, x)  # so every run writes fresh gradients, none adds
        times.append(statistics.median(runs[1:]))
        x = _detached(y)
    return times


def layer_memory(
    module: nn.Sequential,
    sample: Activations,
    *,
    device: torch.device | str | None = None,
) -> list[int]:
    """Bytes each top-level layer holds during training on ``sample``.

    Counted per layer:

    * activations: tensors autograd saves during the layer's forward to use in backward,
      found with `torch.autograd.graph.saved_tensors_hooks` (works on any device). We
      count whole *storages*, each once: two saved views of one buffer (``x * x`` saves
      ``x`` twice) cost its memory once, and a saved small view keeps its whole buffer
      alive. Saved parameters are not activations and are left out here.
    * parameters: their bytes, doubled for those that require grad (the gradient has the
      same size). Shared parameters count once, as in `layer_params`.

    Not counted: optimizer state (depends on the optimizer), temporaries freed within
    forward, and the layer's output unless a later layer saves it (that layer is then
    charged). A tensor saved by two adjacent layers, like a ReLU output feeding a Linear,
    is charged to both: if a cut falls between them both stages really do hold it.

    Activation memory grows with the batch, so pass one micro-batch as ``sample``.
    Layers run on a copy in training mode, the given module is untouched; ``device``
    defaults to the device of ``sample``.
    """
    _check_sequential(module, "layer_memory")
    x, device = _first_input(sample, device)
    activations = []
    for layer in _profiling_copies(module, device):
        saved, y = _saved_activation_bytes(layer, x)
        activations.append(saved)
        x = _detached(y)
    return [a + p for a, p in zip(activations, _param_bytes(module))]


def _saved_activation_bytes(layer: nn.Module, x: Activations) -> tuple[int, Activations]:
    parameters = {_storage_key(p) for p in layer.parameters()}
    saved: dict[tuple[torch.device, int], int] = {}

    def pack(tensor: Tensor) -> Tensor:
        key = _storage_key(tensor)
        if key not in parameters:
            saved[key] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = layer(x)
    return sum(saved.values()), y


def _storage_key(tensor: Tensor) -> tuple[torch.device, int]:
    storage = tensor.untyped_storage()
    return storage.device, storage.data_ptr()


def _param_bytes(module: nn.Sequential) -> list[int]:
    seen: set[int] = set()
    sizes = []
    for layer in module:
        fresh = [p for p in layer.parameters() if id(p) not in seen]
        seen.update(id(p) for p in fresh)
        sizes.append(
            sum(p.numel() * p.element_size() * (2 if p.requires_grad else 1) for p in fresh)
        )
    return sizes


# --------------------------------------------------------------------------- balancing


def balance_by_params(module: nn.Sequential, stages: int) -> list[int]:
    """Balance that evens out the parameter count per stage (see `layer_params`).

    Cheap and needs no sample, but blind to compute: a convolution with few weights may
    be the slowest layer. Use it to even out weight memory.
    """
    return optimal_split(layer_params(module), stages)


def balance_by_time(
    module: nn.Sequential,
    sample: Activations,
    stages: int,
    *,
    repeats: int = 5,
    device: torch.device | str | None = None,
) -> list[int]:
    """Balance that evens out forward+backward time per stage (see `layer_times`).

    Time is what a pipeline's throughput depends on, so this is usually the one to use;
    measure on the hardware you will train on.
    """
    _check_sequential(module, "balance_by_time")
    _check_stages(stages, len(module))
    return optimal_split(layer_times(module, sample, repeats=repeats, device=device), stages)


def balance_by_memory(
    module: nn.Sequential,
    sample: Activations,
    stages: int,
    *,
    device: torch.device | str | None = None,
) -> list[int]:
    """Balance that evens out training memory per stage (see `layer_memory`).

    Use it when the model barely fits and the largest stage must fit on one device.
    """
    _check_sequential(module, "balance_by_memory")
    _check_stages(stages, len(module))
    return optimal_split(layer_memory(module, sample, device=device), stages)


# --------------------------------------------------------------------------- helpers


def _check_sequential(module: nn.Module, caller: str) -> None:
    if not isinstance(module, nn.Sequential):
        raise TypeError(
            f"{caller} needs an nn.Sequential, whose top-level layers are the units a "
            f"pipeline can cut between; got {type(module).__name__}. If its forward just "
            "calls its children in order, use nn.Sequential(*model.children()); "
            "otherwise list the blocks yourself: nn.Sequential(embed, *blocks, head)"
        )
    if len(module) == 0:
        raise ValueError(f"{caller} got an empty nn.Sequential: there is nothing to split")


def _profiling_copies(module: nn.Sequential, device: torch.device) -> Iterator[nn.Module]:
    """Yield a training-mode copy of each layer on ``device``, one at a time.

    Copying keeps profiling free of side effects, and only one layer's copy is alive at
    a time, so the extra memory is one layer's worth. Iterating the Sequential itself
    (not ``.children()``, which skips repeats) keeps a module listed twice as two layers.
    """
    for layer in module:
        yield copy.deepcopy(layer).to(device).train()


def _forward_backward(layer: nn.Module, x: Activations) -> Activations:
    y = layer(x)
    outputs = [t for t in _tensors(y) if t.requires_grad]
    if outputs:
        torch.autograd.backward(outputs, [torch.ones_like(t) for t in outputs])
    return y


def _tensors(value: Activations, what: str = "each layer's output") -> list[Tensor]:
    if isinstance(value, Tensor):
        return [value]
    if isinstance(value, tuple):
        return [v for v in value if isinstance(v, Tensor)]
    raise TypeError(
        f"{what} must be a Tensor or a tuple of Tensors, got {type(value).__name__}"
    )


def _detached(value: Activations) -> Activations:
    """The next layer's input: same data, but a fresh leaf so backward stops here."""
    if isinstance(value, Tensor):
        return value.detach().requires_grad_(value.requires_grad)
    _tensors(value)  # rejects anything that is not a tuple
    return tuple(_detached(v) if isinstance(v, Tensor) else v for v in value)


def _clear_grads(layer: nn.Module, x: Activations) -> None:
    layer.zero_grad(set_to_none=True)
    for t in _tensors(x):
        t.grad = None


def _first_input(
    sample: Activations, device: torch.device | str | None
) -> tuple[Activations, torch.device]:
    """The first layer's input on the profiling device (by default the sample's own).

    Detached like every other layer's input, so the caller's ``sample.grad`` is untouched.
    """
    tensors = _tensors(sample, "sample")
    if not tensors:
        raise TypeError("sample contains no tensor: pass one micro-batch of input")
    device = torch.device(device) if device is not None else tensors[0].device
    if isinstance(sample, Tensor):
        return _detached(sample.to(device)), device
    moved = tuple(v.to(device) if isinstance(v, Tensor) else v for v in sample)
    return _detached(moved), device


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def group_layers(module: nn.Sequential, balance: Sequence[int] | None) -> list[nn.Module]:
    """Stages from consecutive layers: ``balance[k]`` layers in stage k, or one child each."""
    layers = list(module.children())
    if balance is None:
        return layers
    balance = list(balance)
    if any(not isinstance(b, int) or b < 1 for b in balance):
        raise ValueError(f"balance must be positive layer counts, got {balance}")
    if sum(balance) != len(layers):
        raise ValueError(f"balance {balance} sums to {sum(balance)} but the module has "
                         f"{len(layers)} layers; the counts must add up to the number of "
                         f"layers (see pipeline_lib.partition to compute one)")
    stages, start = [], 0
    for count in balance:
        stages.append(nn.Sequential(*layers[start:start + count]))
        start += count
    return stages
