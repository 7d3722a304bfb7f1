"""What one stage does for each action, independent of how activations travel.

Both executors (threads in one process, one process per rank) drive a `StageRunner` per
stage and only differ in how they move its inputs and outputs. A stage's input arrives
detached from the previous stage's graph, as a leaf that requires grad: its ``.grad``
after the backward is exactly what the previous stage needs. The stage graphs are thus
separate and each backward is an explicit call, which is what lets a schedule order them.
"""
from __future__ import annotations

from typing import Any, Callable, ContextManager, Mapping

import torch
from torch import Tensor, nn

from pipeline_lib.checkpoint import checkpointed, checkpointing, recomputing
from pipeline_lib.rng import microbatch_rng, seed_for
from pipeline_lib.skip import SkipKey, SkipTracker, describe, use_tracker

LossFn = Callable[[Any, Any], Tensor]
# (seed, device) -> the block in which a micro-batch draws its random numbers
RandomStream = Callable[[int, torch.device], ContextManager[None]]


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

    ``rng`` gives each micro-batch its random stream (`rng.microbatch_rng`, or
    `rng.owned_rng` where one thread runs every stage of the process).

    Skip connections (see `skip`) travel beside the activations: ``forward(..., skips=)``
    takes the tensors this stage pops that earlier stages stashed, and `take_stashed`
    gives what it stashed for later stages; ``backward(..., skip_grads=)`` takes the
    gradients of those stashed tensors, and `take_skip_grads` gives the gradients of the
    popped ones, to send back to the stages that stashed them. Without skips, all of this
    stays empty.
    """

    def __init__(self, stage: int, module: nn.Module, device: torch.device,
                 checkpoint: str, microbatches: int, step_seed: int,
                 loss_fn: LossFn | None = None, loss_weights: list[float] | None = None,
                 first: bool = False, rng: RandomStream = microbatch_rng):
        self.stage, self.module, self.device = stage, module, device
        self.checkpoint, self.microbatches, self.step_seed = checkpoint, microbatches, step_seed
        self.loss_fn, self.loss_weights, self.first = loss_fn, loss_weights, first
        self.rng = rng
        self.inputs: dict[int, Any] = {}
        self.targets: dict[int, Any] = {}
        self.outputs: dict[int, Any] = {}       # graph kept for the backward
        self.skips_in: dict[int, dict[SkipKey, Tensor]] = {}     # popped here, as leaves
        self.skips_out: dict[int, dict[SkipKey, Tensor]] = {}    # stashed here, to send
        self.skip_grads_out: dict[int, dict[SkipKey, Tensor | None]] = {}
        self.pending_weight: dict[int, tuple[list[Tensor], list[Tensor | None]]] = {}
        self.losses: dict[int, Tensor] = {}

    @property
    def last(self) -> bool:
        return self.loss_fn is not None

    def _run(self, microbatch: int, inputs: Any) -> tuple[Any, dict[SkipKey, Tensor]]:
        """The stage's output and the tensors it stashed for later stages."""
        tracker = SkipTracker(self.skips_in[microbatch])
        with (self.rng(seed_for(self.step_seed, self.stage, microbatch), self.device),
              use_tracker(tracker)):
            out = self.module(inputs)
            if self.last:
                loss = self.loss_fn(out, self.targets[microbatch])
                out = loss * self.loss_weights[microbatch]
        return out, tracker.stashed

    def forward(self, microbatch: int, inputs: Any, target: Any = None,
                skips: Mapping[SkipKey, Tensor] | None = None) -> Any:
        """Run the forward; return what goes to the next stage (the weighted loss on the
        last stage), detached."""
        inputs = inputs if self.first else detach_as_leaf(inputs)
        self.inputs[microbatch] = inputs
        self.skips_in[microbatch] = {key: detach_as_leaf(t) for key, t in (skips or {}).items()}
        if self.last:
            self.targets[microbatch] = target
        if checkpointed(self.checkpoint, microbatch, self.microbatches):
            with torch.no_grad(), checkpointing():
                out, stashed = self._run(microbatch, inputs)
        else:
            out, stashed = self.outputs[microbatch] = self._run(microbatch, inputs)
        if stashed:
            self.skips_out[microbatch] = {key: t.detach() for key, t in stashed.items()}
        if self.last:
            self.losses[microbatch] = out.detach()
        return detach(out)

    def take_stashed(self, microbatch: int) -> dict[SkipKey, Tensor]:
        """What the forward of ``microbatch`` stashed for later stages, detached, to send."""
        return self.skips_out.pop(microbatch, {})

    def take_skip_grads(self, microbatch: int) -> dict[SkipKey, Tensor | None]:
        """After the backward (or I) of ``microbatch``: the gradients of the tensors it
        popped, to send to the stages that stashed them (None where one got none)."""
        return self.skip_grads_out.pop(microbatch, {})

    def _graph(self, microbatch: int) -> tuple[Any, dict[SkipKey, Tensor]]:
        """The forward graph of a micro-batch, recomputed if it was checkpointed."""
        if microbatch not in self.outputs:
            with recomputing():
                return self._run(microbatch, self.inputs[microbatch])
        return self.outputs.pop(microbatch)

    def _pairs(self, microbatch: int, grad: Any,
               skip_grads: Mapping[SkipKey, Tensor | None] | None
               ) -> tuple[list[Tensor], list[Tensor | None]]:
        """The tensors to differentiate and their gradients: the stage's outputs, and the
        tensors it stashed (their gradients come from the stages that popped them)."""
        out, stashed = self._graph(microbatch)
        outputs = flatten(out)
        grads = [None] * len(outputs) if self.last else flatten(grad)
        if len(grads) != len(outputs):
            raise RuntimeError(f"stage {self.stage}: got {len(grads)} gradients for "
                               f"{len(outputs)} output tensors of micro-batch {microbatch}")
        pairs = [(t, g) for t, g in zip(outputs, grads) if t.requires_grad]
        skip_grads = skip_grads or {}
        for key, t in stashed.items():
            if t.requires_grad and key not in skip_grads:
                raise RuntimeError(f"stage {self.stage}: micro-batch {microbatch} stashed "
                                   f"{describe(key)} but its gradient was not given; pass "
                                   f"backward(..., skip_grads=...) what take_skip_grads "
                                   f"returned on the stage that popped it")
            if t.requires_grad and skip_grads[key] is not None:
                pairs.append((t, skip_grads[key]))
        return [t for t, _ in pairs], [g for _, g in pairs]

    def _skip_leaves(self, microbatch: int) -> dict[SkipKey, Tensor]:
        return {key: t for key, t in self.skips_in[microbatch].items() if t.requires_grad}

    def _input_grads(self, microbatch: int, grads: list[Tensor | None],
                     skip_grads: dict[SkipKey, Tensor | None]) -> Any:
        """Gradients for the previous stage, shaped like the input (zeros if unused)."""
        inputs = self.inputs.pop(microbatch)
        self.targets.pop(microbatch, None)
        popped = self.skips_in.pop(microbatch)
        if popped:
            self.skip_grads_out[microbatch] = {key: skip_grads.get(key) for key in popped}
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

    def backward(self, microbatch: int, grad: Any = None,
                 skip_grads: Mapping[SkipKey, Tensor | None] | None = None) -> Any:
        """Full backward (B): weight gradients accumulate, input gradients are returned."""
        outputs, grads = self._pairs(microbatch, grad, skip_grads)
        leaves, skip_leaves = self._leaves(microbatch), self._skip_leaves(microbatch)
        if outputs:
            torch.autograd.backward(outputs, grads)
        return self._input_grads(microbatch, [t.grad for t in leaves],
                                 {key: t.grad for key, t in skip_leaves.items()})

    def backward_input(self, microbatch: int, grad: Any = None,
                       skip_grads: Mapping[SkipKey, Tensor | None] | None = None) -> Any:
        """I of a split backward: only the input gradient, which the previous stage waits
        for. The graph is kept for the W that follows."""
        outputs, grads = self._pairs(microbatch, grad, skip_grads)
        leaves, skip_leaves = self._leaves(microbatch), self._skip_leaves(microbatch)
        wanted = leaves + list(skip_leaves.values())
        found: list[Tensor | None] = [None] * len(wanted)
        if wanted and outputs:
            found = list(torch.autograd.grad(outputs, wanted, grads, retain_graph=True,
                                             allow_unused=True))
        self.pending_weight[microbatch] = (outputs, grads)
        return self._input_grads(microbatch, found[:len(leaves)],
                                 dict(zip(skip_leaves, found[len(leaves):])))

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
