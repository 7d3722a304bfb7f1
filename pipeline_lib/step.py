"""A training step around the executor loop, written once for both executors.

`Pipe.step` and `DistributedPipe.step` do the same things around `executor.run_program`;
only the last two differ in what they ask of the other ranks:

1. split the batch into micro-batches, the same rows for the same micro-batch in both
   executors (`split_batch`, which also gives each replica of data parallelism its
   slice), and weight each micro-batch's loss by its share of the batch's rows;
2. make a `StageRunner` per stage (`make_runners`);
3. set ``.grad`` aside, run the programs, and either commit the step's gradients scaled
   for the batch's loss or, if anything failed or was interrupted, restore ``.grad`` as
   it was (`train_step`), each of them whole (see `interrupts`);
4. add the micro-batches' losses into the batch's (`local_loss`).
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping

import torch
from torch import Tensor, nn

from pipeline_lib import tree
from pipeline_lib.devices import pinned
from pipeline_lib.loss import MicroLoss, StepGradients, check_count, check_losses
from pipeline_lib.microbatch import NoChunk, check_rows, loss_weights, split
from pipeline_lib.rng import RandomStream
from pipeline_lib.stage import LossFn, StageRunner
from pipeline_lib.interrupts import interrupts_held


def _among(batch: Any, replicas: int) -> list[Any]:
    """`microbatch.split` among replicas, keeping `NoChunk` tensors wrapped, so that the
    second split (into micro-batches) also hands them whole to every micro-batch."""
    kept = [isinstance(leaf, NoChunk) for leaf in tree.leaves(batch)]
    return [tree.unflatten([NoChunk(leaf) if keep else leaf
                            for leaf, keep in zip(tree.leaves(part), kept)], batch)
            for part in split(batch, replicas)]


def split_batch(inputs: Any, target: Any, microbatches: int, replicas: int = 1,
                replica: int = 0, pin: bool = False) -> tuple[list[Any], list[Any], list[float]]:
    """Replica ``replica``'s micro-batches of inputs and targets, and their loss weights.

    The global batch is split among ``replicas`` first, then each slice into
    ``microbatches``; the weights are each micro-batch's share of the global batch's
    rows (`microbatch.loss_weights`), times ``replicas``, since DDP averages the
    replicas' gradients: their average is then the gradient of the global mean loss.
    ``pin``: a stage is on a GPU; the micro-batches' CPU tensors are put in page-locked
    memory (`devices.pinned`), once, so that their copies to the GPU do not block."""
    micro_in, micro_target, weights = _split_batch(inputs, target, microbatches, replicas,
                                                   replica)
    if pin:
        micro_in, micro_target = pinned(micro_in), pinned(micro_target)
    return micro_in, micro_target, weights


def _split_batch(inputs: Any, target: Any, microbatches: int, replicas: int,
                 replica: int) -> tuple[list[Any], list[Any], list[float]]:
    check_rows(inputs, target)
    if replicas == 1:
        micro_in, micro_target = split(inputs, microbatches), split(target, microbatches)
        return micro_in, micro_target, loss_weights(micro_target)
    try:
        replica_inputs, replica_targets = _among(inputs, replicas), _among(target, replicas)
    except ValueError as exc:
        exc.add_note(f"while splitting the global batch among {replicas} data-parallel "
                     f"replicas")
        raise
    targets = [split(t, microbatches) for t in replica_targets]
    weights = loss_weights([t for replica_micro in targets for t in replica_micro])
    mine = [w * replicas for w in weights[replica * microbatches:(replica + 1) * microbatches]]
    return split(replica_inputs[replica], microbatches), targets[replica], mine


def make_runners(stages: Mapping[int, tuple[nn.Module, torch.device]], last: int,
            checkpoint: str, microbatches: int, step_seed: int, loss_fn: LossFn,
            weights: list[float], rng: RandomStream,
            inputs: Any = None) -> dict[int, StageRunner]:
    """A `StageRunner` per stage of ``stages`` (stage -> (module, device)); stage
    ``last`` computes the loss. Stage 0 uses the caller's batch ``inputs`` as given,
    unless a tensor in it requires grad: then it computes their gradients, for
    `StageRunner.backward_into_caller`."""
    wanted = any(t.requires_grad for t in tree.tensors(tree.map_leaves(_unwrapped, inputs)))
    return {s: StageRunner(s, module, device, checkpoint, microbatches, step_seed,
                           loss_fn=loss_fn if s == last else None, loss_weights=weights,
                           input_as_given=s == 0 and not wanted, rng=rng,
                           caller_input_grads=s == 0 and wanted)
            for s, (module, device) in stages.items()}


def _unwrapped(leaf: Any) -> Any:
    return leaf.tensor if isinstance(leaf, NoChunk) else leaf


def train_step(parameters: Iterable[nn.Parameter],
               run: Callable[[], tuple[Tensor | None, float]],
               gradients: type[StepGradients] = StepGradients) -> Tensor | None:
    """Run ``run`` with ``.grad`` set aside by ``gradients`` (`StepGradients`, or a
    subclass: the tests interrupt its methods); ``run`` returns the batch's loss and the
    factor the gradients it added are scaled by (`StepGradients.commit`). If it raises (a
    stage failed, Ctrl-C), ``.grad`` is put back as it was. Setting aside, restoring
    and committing each run with Ctrl-C held: whole or not at all, never some
    parameters and not others; an interrupt while committing comes after the step,
    which then counts."""
    grads: StepGradients | None = None
    try:
        with interrupts_held():
            grads = gradients(parameters)
        loss, scale = run()
    except BaseException:
        with interrupts_held():
            if grads is not None:
                grads.discard()
        raise
    with interrupts_held():
        grads.commit(scale)
    return loss


def local_loss(losses: list[MicroLoss]) -> tuple[Tensor, float | None]:
    """The sum of the micro-batches' weighted losses (or loss sums), on the device, and
    of their counts, read on the host (None for mean losses), once `check_losses` has
    checked them: the step's one read of the device."""
    total = check_losses(losses)
    return torch.stack([loss.value for loss in losses]).sum(), total


def batch_loss(losses: list[MicroLoss]) -> tuple[Tensor, float]:
    """The batch's loss from all of its micro-batches' losses, and the factor for
    `train_step`: 1 for means (the weights did the scaling), 1 / Σ count for sums."""
    loss, total = local_loss(losses)
    if total is None:
        return loss, 1.0
    check_count(total)
    return loss / total, 1.0 / total
