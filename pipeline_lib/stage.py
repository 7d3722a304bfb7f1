"""What one stage does for each action, independent of how activations travel.

Both executors (threads in one process, one process per rank) drive a `StageRunner` per
stage and only differ in how they move its inputs and outputs. A stage's input arrives
detached from the previous stage's graph, as a leaf that requires grad: its ``.grad``
after the backward is exactly what the previous stage needs. The stage graphs are thus
separate and each backward is an explicit call, which is what lets a schedule order them.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch import Tensor, nn

from .checkpoint import checkpointed, checkpointing, recomputing
from .rng import microbatch_rng, seed_for

LossFn = Callable[[Any, Any], Tensor]


def flatten(value: Any) -> list[Tensor]:
    """The tensors of an activation (a tensor or a tuple), in order."""
    if isinstance(value, Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [v for v in value if isinstance(v, Tensor)]
    return []


def detach_as_leaf(value: Any) -> Any:
    """Cut the graph at a stage boundary; floating tensors become leaves needing grad."""
    if isinstance(value, Tensor):
        return value.detach().requires_grad_(value.is_floating_point())
    if isinstance(value, tuple):
        return tuple(detach_as_leaf(v) for v in value)
    return value


def detach(value: Any) -> Any:
    if isinstance(value, Tensor):
        return value.detach()
    if isinstance(value, tuple):
        return tuple(detach(v) for v in value)
    return value


class StageRunner:
    """Forward and backward of one stage, one micro-batch at a time.

    ``loss_fn`` and ``loss_weights`` are given to the last stage only: it turns its
    output into micro-batch i's share of the batch loss, ``loss_fn(out, target) * w_i``
    (see `microbatch.loss_weights`).
    """

    def __init__(self, stage: int, module: nn.Module, device: torch.device,
                 checkpoint: str, microbatches: int, step_seed: int,
                 loss_fn: LossFn | None = None, loss_weights: list[float] | None = None,
                 first: bool = False):
        self.stage, self.module, self.device = stage, module, device
        self.checkpoint, self.microbatches, self.step_seed = checkpoint, microbatches, step_seed
        self.loss_fn, self.loss_weights, self.first = loss_fn, loss_weights, first
        self.inputs: dict[int, Any] = {}
        self.targets: dict[int, Any] = {}
        self.outputs: dict[int, Any] = {}       # graph kept for the backward
        self.pending_weight: dict[int, tuple[list[Tensor], list[Tensor | None]]] = {}
        self.losses: dict[int, Tensor] = {}

    @property
    def last(self) -> bool:
        return self.loss_fn is not None

    def _run(self, microbatch: int, inputs: Any) -> Any:
        with microbatch_rng(seed_for(self.step_seed, self.stage, microbatch), self.device):
            out = self.module(inputs)
            if self.last:
                loss = self.loss_fn(out, self.targets[microbatch])
                out = loss * self.loss_weights[microbatch]
        return out

    def forward(self, microbatch: int, inputs: Any, target: Any = None) -> Any:
        """Run the forward; return what goes to the next stage (the weighted loss on the
        last stage), detached."""
        inputs = inputs if self.first else detach_as_leaf(inputs)
        self.inputs[microbatch] = inputs
        if self.last:
            self.targets[microbatch] = target
        if checkpointed(self.checkpoint, microbatch, self.microbatches):
            with torch.no_grad(), checkpointing():
                out = self._run(microbatch, inputs)
        else:
            out = self.outputs[microbatch] = self._run(microbatch, inputs)
        if self.last:
            self.losses[microbatch] = out.detach()
        return detach(out)

    def _graph(self, microbatch: int) -> Any:
        """The forward graph of a micro-batch, recomputed if it was checkpointed."""
        if microbatch not in self.outputs:
            with recomputing():
                return self._run(microbatch, self.inputs[microbatch])
        return self.outputs.pop(microbatch)

    def _pairs(self, microbatch: int, grad: Any) -> tuple[list[Tensor], list[Tensor | None]]:
        outputs = flatten(self._graph(microbatch))
        grads = [None] * len(outputs) if self.last else flatten(grad)
        if len(grads) != len(outputs):
            raise RuntimeError(f"stage {self.stage}: got {len(grads)} gradients for "
                               f"{len(outputs)} output tensors of micro-batch {microbatch}")
        keep = [k for k, t in enumerate(outputs) if t.requires_grad]
        return [outputs[k] for k in keep], [grads[k] for k in keep]

    def _input_grads(self, microbatch: int, grads: list[Tensor | None]) -> Any:
        """Gradients for the previous stage, shaped like the input (zeros if unused)."""
        inputs = self.inputs.pop(microbatch)
        self.targets.pop(microbatch, None)
        if self.first:
            return None
        it = iter(grads)

        def fill(v: Any) -> Any:
            if isinstance(v, Tensor) and v.requires_grad:
                g = next(it)
                return torch.zeros_like(v) if g is None else g
            return None
        return fill(inputs) if isinstance(inputs, Tensor) else tuple(fill(v) for v in inputs)

    def _leaves(self, microbatch: int) -> list[Tensor]:
        return [] if self.first else [t for t in flatten(self.inputs[microbatch])
                                      if t.requires_grad]

    def backward(self, microbatch: int, grad: Any = None) -> Any:
        """Full backward (B): weight gradients accumulate, input gradients are returned."""
        outputs, grads = self._pairs(microbatch, grad)
        leaves = self._leaves(microbatch)
        if outputs:
            torch.autograd.backward(outputs, grads)
        return self._input_grads(microbatch, [t.grad for t in leaves])

    def backward_input(self, microbatch: int, grad: Any = None) -> Any:
        """I of a split backward: only the input gradient, which the previous stage waits
        for. The graph is kept for the W that follows."""
        outputs, grads = self._pairs(microbatch, grad)
        leaves = self._leaves(microbatch)
        input_grads: list[Tensor | None] = []
        if leaves and outputs:
            input_grads = list(torch.autograd.grad(outputs, leaves, grads, retain_graph=True,
                                                   allow_unused=True))
        self.pending_weight[microbatch] = (outputs, grads)
        return self._input_grads(microbatch, input_grads)

    def backward_weight(self, microbatch: int) -> None:
        """W of a split backward: the weight gradients, off the critical path.

        Autograd cannot resume a backward half-way, so W walks the stage's graph again
        (computing only what leads to the weights): W costs about as much as a full
        backward, and I + W more than B. The schedule still gains wherever W fills an
        otherwise idle slot; the simulator's ``weight`` cost models this.
        """
        outputs, grads = self.pending_weight.pop(microbatch)
        params = [p for p in self.module.parameters() if p.requires_grad]
        if outputs and params:
            torch.autograd.backward(outputs, grads, inputs=params)
