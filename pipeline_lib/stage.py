"""What one stage does for each action, independent of how activations travel.

Both executors (threads in one process, one process per rank) drive a `StageRunner` per
stage from the same loop, `executor.run_program`, and only differ in how they move its
inputs and outputs (their `executor.Transport`); the classic ``pipe(x)`` runs the same
loop over the same runners, wired into autograd. A stage's input arrives detached from the
previous stage's graph, as a leaf that requires grad: its ``.grad`` after the backward is
exactly what the previous stage needs. The stage graphs are thus separate and each
backward is an explicit call, which is what lets a schedule order them.

Inputs, outputs and gradients may be trees (tuples, lists, dicts of tensors, see `tree`);
a gradient has the structure of the activation it belongs to, None where a leaf needs no
gradient (an integer tensor, a flag, an input the stage did not use).

Activation checkpointing happens here, and only here: a checkpointed micro-batch's
forward runs under ``torch.no_grad()`` keeping only its input, and the backward first
replays the forward with autograd on (`pipeline_lib.checkpoint` has the policy and the
flags that layers read).
"""
from __future__ import annotations

from typing import Any, Callable, Mapping

import torch
from torch import Tensor, nn

from pipeline_lib import split_backward, tree
from pipeline_lib.checkpoint import checkpointed, checkpointing, recomputing
from pipeline_lib.deprecation import renamed_keywords
from pipeline_lib.loss import MicroLoss, micro_loss
from pipeline_lib.rng import RandomStream, seed_for, shared_rng
from pipeline_lib.skip import SkipKey, SkipTracker, describe, use_tracker

LossFn = Callable[[Any, Any], Any]   # -> a mean-reduced loss, or SumCount(loss_sum, count)


def detach_as_leaf(value: Any) -> Any:
    """Cut the graph at a stage boundary; floating tensors become leaves needing grad."""
    return tree.map_tensors(lambda t: t.detach().requires_grad_(t.is_floating_point()), value)


def detach(value: Any) -> Any:
    return tree.map_tensors(Tensor.detach, value)


class _Alias(torch.autograd.Function):
    """The same tensor (no copy) as an autograd node's output rather than a leaf, so that
    an in-place first layer (``nn.ReLU(inplace=True)``) may modify it: autograd forbids
    modifying a leaf that requires grad, or a view of one, in place."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        return x.detach()

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        return grad


def _owned(value: Any, copy: bool) -> Any:
    """What the stage module is handed: its input as non-leaf aliases, or as copies for
    the first run of a checkpointed micro-batch, whose input must reach the replay as it
    was even if the first layer works in place."""
    if copy:
        return tree.map_tensors(torch.clone, value)
    return tree.map_tensors(lambda t: _Alias.apply(t) if t.requires_grad else t, value)


class StageRunner:
    """Forward and backward of one stage, one micro-batch at a time.

    ``loss_fn`` and ``loss_weights`` are given to the last stage only: it turns its
    output into micro-batch i's share of the batch loss: ``loss_fn(out, target) * w_i``
    for a mean-reduced loss (see `microbatch.loss_weights`), or the ``loss_sum`` of a
    ``SumCount(loss_sum, count)``, unscaled (see `pipeline_lib.loss`). ``losses[i]`` keeps
    that value, detached, as a `loss.MicroLoss` (with the count, or None).

    ``rng`` gives each micro-batch its random stream (`rng.shared_rng`, or
    `rng.owned_rng` where one thread runs every stage of the process). ``input_as_given``:
    the input comes from the caller (not from another stage) and is used as it is: not
    detached, and no gradient is computed for it (``first`` is its deprecated name).
    ``caller_input_grads``: the input comes from the caller, who wants the gradients of
    its tensors that require grad; they are computed like a later stage's (also by I) and
    kept, and once the step knows the loss's scale, `backward_into_caller` hands them to
    the caller's graph in one backward, as ``loss.backward()`` would have.

    Skip connections (see `skip`) travel beside the activations: ``forward(..., skips=)``
    takes the tensors this stage pops that earlier stages stashed, and `take_stashed`
    gives what it stashed for later stages; ``backward(..., skip_grads=)`` takes the
    gradients of those stashed tensors, and `take_skip_grads` gives the gradients of the
    popped ones, to send back to the stages that stashed them. Without skips, all of this
    stays empty.
    """

    @renamed_keywords(first="input_as_given")
    def __init__(self, stage: int, module: nn.Module, device: torch.device,
                 checkpoint: str, microbatches: int, step_seed: int,
                 loss_fn: LossFn | None = None, loss_weights: list[float] | None = None,
                 input_as_given: bool = False, rng: RandomStream = shared_rng,
                 caller_input_grads: bool = False):
        self.stage, self.module, self.device = stage, module, device
        self.checkpoint, self.microbatches, self.step_seed = checkpoint, microbatches, step_seed
        self.loss_fn, self.loss_weights = loss_fn, loss_weights
        self.input_as_given = input_as_given
        self.caller_input_grads = caller_input_grads
        self.caller_inputs: dict[int, Any] = {}   # as given, still in the caller's graph
        self.caller_grads: dict[int, Any] = {}    # their gradients, unscaled
        self.rng = rng
        self.inputs: dict[int, Any] = {}
        self.targets: dict[int, Any] = {}
        self.outputs: dict[int, Any] = {}       # graph kept for the backward
        self.skips_in: dict[int, dict[SkipKey, Tensor]] = {}     # popped here, as leaves
        self.skips_out: dict[int, dict[SkipKey, Tensor]] = {}    # stashed here, to send
        self.skip_grads_out: dict[int, dict[SkipKey, Tensor | None]] = {}
        self.pending_weight: dict[int, split_backward.WeightGradients] = {}
        self.losses: dict[int, MicroLoss] = {}

    @property
    def last(self) -> bool:
        return self.loss_fn is not None

    def _run(self, microbatch: int, copy: bool) -> tuple[Any, dict[SkipKey, Tensor]]:
        """The stage's output (its weighted loss on the last stage) and the tensors it
        stashed for later stages."""
        tracker = SkipTracker(self.skips_in[microbatch])
        with (self.rng(seed_for(self.step_seed, self.stage, microbatch), self.device,
                       self.module), use_tracker(tracker)):
            out = self.module(_owned(self.inputs[microbatch], copy))
            if self.last:
                loss = micro_loss(self.loss_fn(out, self.targets[microbatch]), microbatch,
                                  need_grad=torch.is_grad_enabled(), output=out)
                out = loss.value * self.loss_weights[microbatch] if loss.count is None \
                    else loss.value
                # (a replay's loss is not kept: the first pass's is)
                self.losses.setdefault(microbatch, loss._replace(value=out.detach()))
        return out, tracker.stashed

    def forward(self, microbatch: int, inputs: Any, target: Any = None,
                skips: Mapping[SkipKey, Tensor] | None = None) -> Any:
        """Run the forward; return what goes to the next stage (the weighted loss on the
        last stage), detached."""
        if self.input_as_given:
            self.inputs[microbatch] = inputs
        elif self.caller_input_grads:   # a gradient for what requires one, as the caller said
            self.caller_inputs[microbatch] = inputs
            self.inputs[microbatch] = tree.map_tensors(
                lambda t: t.detach().requires_grad_(t.requires_grad), inputs)
        else:
            self.inputs[microbatch] = detach_as_leaf(inputs)
        self.skips_in[microbatch] = {key: detach_as_leaf(t) for key, t in (skips or {}).items()}
        if self.last:
            self.targets[microbatch] = target
        if torch.is_grad_enabled() and checkpointed(self.checkpoint, microbatch,
                                                    self.microbatches):
            with torch.no_grad(), checkpointing():
                out, stashed = self._run(microbatch, copy=True)
        else:
            out, stashed = self.outputs[microbatch] = self._run(microbatch, copy=False)
        if stashed:
            self.skips_out[microbatch] = {key: detach(t) for key, t in stashed.items()}
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
        if microbatch not in self.inputs:
            raise RuntimeError(f"stage {self.stage}: the backward of micro-batch "
                               f"{microbatch} ran twice, or without its forward (a graph "
                               f"from pipe(x) can be backpropagated once: no retain_graph)")
        if microbatch not in self.outputs:
            with recomputing(self.module):
                return self._run(microbatch, copy=False)
        return self.outputs.pop(microbatch)

    def _pairs(self, microbatch: int, grad: Any,
               skip_grads: Mapping[SkipKey, Tensor | None] | None
               ) -> tuple[list[Tensor], list[Tensor | None]]:
        """The tensors to differentiate and their gradients: the stage's outputs, and the
        tensors it stashed (their gradients come from the stages that popped them)."""
        out, stashed = self._graph(microbatch)
        outputs = tree.leaves(out)
        grads = [None] if self.last else tree.leaves(grad)
        if len(grads) != len(outputs):
            raise RuntimeError(f"stage {self.stage}: got {len(grads)} gradients for the "
                               f"{len(outputs)} leaves of micro-batch {microbatch}'s output")
        pairs = [(t, g) for t, g in zip(outputs, grads) if isinstance(t, Tensor)
                 and t.requires_grad and (g is not None or self.last)]
        skip_grads = skip_grads or {}
        for key, t in stashed.items():
            if not isinstance(t, Tensor):   # stash(name, None)
                continue
            if t.requires_grad and key not in skip_grads:
                raise RuntimeError(f"stage {self.stage}: micro-batch {microbatch} stashed "
                                   f"{describe(key)} but its gradient was not given; pass "
                                   f"backward(..., skip_grads=...) what take_skip_grads "
                                   f"returned on the stage that popped it")
            if t.requires_grad and skip_grads[key] is not None:
                pairs.append((t, skip_grads[key]))
        return [t for t, _ in pairs], [g for _, g in pairs]

    def _skip_leaves(self, microbatch: int) -> dict[SkipKey, Tensor]:
        return {key: t for key, t in self.skips_in[microbatch].items()
                if isinstance(t, Tensor) and t.requires_grad}

    def _input_grads(self, microbatch: int, grads: list[Tensor | None],
                     skip_grads: dict[SkipKey, Tensor | None]) -> Any:
        """Gradients for the previous stage, shaped like the input: None where a leaf
        needs none or got none (an input the stage did not use)."""
        inputs = self.inputs.pop(microbatch)
        self.targets.pop(microbatch, None)
        popped = self.skips_in.pop(microbatch)
        if popped:
            self.skip_grads_out[microbatch] = {key: skip_grads.get(key) for key in popped}
        if self.input_as_given:
            return None
        it = iter(grads)
        found = tree.map_leaves(
            lambda v: next(it) if isinstance(v, Tensor) and v.requires_grad else None, inputs)
        if self.caller_input_grads:
            self.caller_grads[microbatch] = found
        return found

    def backward_into_caller(self, scale: float) -> None:
        """After the step (``caller_input_grads``): the input gradients of every
        micro-batch, times ``scale`` (the step's factor for its gradients, 1 / Σ count for
        ``SumCount``), backpropagated into the caller's graph in one backward: the
        caller's inputs (or what they were computed from) get the batch loss's gradient."""
        roots, grads = [], []
        for i, given in self.caller_inputs.items():
            for t, g in zip(tree.leaves(given), tree.leaves(self.caller_grads.get(i))):
                if isinstance(g, Tensor):
                    roots.append(t)
                    grads.append(g if scale == 1.0 else g * scale)
        self.caller_inputs, self.caller_grads = {}, {}
        if roots:
            torch.autograd.backward(roots, grads)

    def _leaves(self, microbatch: int) -> list[Tensor]:
        return [] if self.input_as_given else [t for t in tree.tensors(self.inputs[microbatch])
                                      if t.requires_grad]

    def backward(self, microbatch: int, grad: Any = None,
                 skip_grads: Mapping[SkipKey, Tensor | None] | None = None,
                 into: dict[Tensor, Tensor] | None = None) -> Any:
        """Full backward (B): weight gradients accumulate, input gradients are returned.
        ``into``: the weight gradients are added there (by parameter) instead of into
        ``.grad``, for a backward that must leave ``.grad`` alone."""
        outputs, grads = self._pairs(microbatch, grad, skip_grads)
        leaves, skip_leaves = self._leaves(microbatch), self._skip_leaves(microbatch)
        if into is None:
            if outputs:
                torch.autograd.backward(outputs, grads)
            return self._input_grads(microbatch, [t.grad for t in leaves],
                                     {key: t.grad for key, t in skip_leaves.items()})
        params = [p for p in self.module.parameters() if p.requires_grad]
        wanted = leaves + list(skip_leaves.values()) + params
        found = list(torch.autograd.grad(outputs, wanted, grads, allow_unused=True)) \
            if outputs and wanted else [None] * len(wanted)
        for p, g in zip(params, found[len(wanted) - len(params):]):
            if g is not None:
                into[p] = into[p] + g if p in into else g
        return self._input_grads(microbatch, found[:len(leaves)],
                                 dict(zip(skip_leaves, found[len(leaves):])))

    def backward_input(self, microbatch: int, grad: Any = None,
                       skip_grads: Mapping[SkipKey, Tensor | None] | None = None) -> Any:
        """I of a split backward: only the input gradient, which the previous stage waits
        for. What W needs (the gradients at the weights' branch points) is kept for it."""
        outputs, grads = self._pairs(microbatch, grad, skip_grads)
        leaves, skip_leaves = self._leaves(microbatch), self._skip_leaves(microbatch)
        wanted = leaves + list(skip_leaves.values())
        params = [p for p in self.module.parameters() if p.requires_grad]
        found, self.pending_weight[microbatch] = split_backward.backward_input(
            outputs, grads, wanted, params)
        return self._input_grads(microbatch, found[:len(leaves)],
                                 dict(zip(skip_leaves, found[len(leaves):])))

    def backward_weight(self, microbatch: int) -> None:
        """W of a split backward: the weight gradients, off the critical path. It starts
        where I stopped (`split_backward`), so I + W costs about what B costs."""
        self.pending_weight.pop(microbatch).run()
