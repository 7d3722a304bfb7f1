"""Sharded data parallelism (FSDP2, ZeRO-3) on a pipeline stage: the parameters sharded
over the replicas, gathered layer by layer, the gradients reduce-scattered once a step.

`torch.distributed.fsdp.fully_shard` keeps 1/d of every parameter on each of the d
replicas. Before a layer's forward it all-gathers the layer's whole parameters; after
the forward it frees them again (``reshard_after_forward=True``: ZeRO-3) or keeps them
until the step ends (``False``: ZeRO-2's memory, one all-gather per step); the backward
gathers them again if they were freed. The gradients are reduce-scattered: each replica
receives the average of its own 1/d slice, which is all its optimizer updates. Against
DDP, which all-reduces the whole gradient (a reduce-scatter and an all-gather, 2(d−1)/d
of the bytes per rank), FSDP moves (d−1)/d of them to reduce and (d−1)/d again for each
all-gather of the parameters: the same bytes when each layer is gathered once a step,
more under ZeRO-3, for 1/d of the memory for parameters, gradients and optimizer states
between steps.

A pipeline runs many forwards and backwards of one stage per step (a micro-batch each),
interleaved with other micro-batches'. Left alone, FSDP would reduce-scatter after every
backward: m times the bytes for the same sum (as DDP would all-reduce m times,
`pipeline_lib.distributed.pipe`). So, as PyTorch's own pipelining runtime does
(``PipelineStage.backward_maybe_with_nosync`` and ``perform_reduce_grad``), every backward
of the step runs with gradient reduction off, the gradients accumulating whole (not
sharded) in each layer, and once the stage's last backward (B, or W of a split backward)
is done, `reduce_gradients` runs each layer's post-backward with reduction on: one
reduce-scatter per layer per step. That also suits the zero-bubble schedules, whose I
reaches FSDP's post-backward hook before W has computed any weight gradient.

During the step, ``reshard_after_forward=True`` frees each layer's parameters after
every forward and after every backward, so each micro-batch gathers them twice (2·m
all-gathers per layer per step); ``False`` gathers them at the step's first forward and
keeps them until `reduce_gradients` (one per step). The whole gradients accumulate
during the step either way: sharded memory holds between steps, not inside one (as in
PyTorch's runtime).

A tensor-parallel stage's weights are `DTensor`s, which ``DistributedDataParallel``
refuses ("mixed torch.Tensor and DTensor" when it builds its buckets). Its replicas use
`replicate_stage` instead: PyTorch's ``replicate`` (``torch.distributed._composable.
replicate_with_fsdp``, which PyTorch's pipelining runtime also drives), DDP's behaviour
on FSDP's machinery, driven by the same two calls: one all-reduce per layer per step.
"""
from __future__ import annotations

import warnings
from typing import Iterable

from torch import nn
from torch.distributed._composable.replicate_with_fsdp import ReplicateModule, replicate
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard


def shard_stage(stage: nn.Sequential, mesh: DeviceMesh, reshard_after_forward: bool = True,
                mp_policy: MixedPrecisionPolicy | None = None) -> FSDPModule:
    """Shard ``stage`` over the replicas of the one-dimensional ``mesh`` (``mesh["dp"]``)
    in place: each layer with parameters a unit of its own (gathered just before it
    runs, so at most about one layer is gathered at a time under ZeRO-3), the stage the
    root. Every rank of ``mesh`` must hold the same weights before. Returns the stage,
    now also an `FSDPModule`."""
    if mesh.ndim != 1:
        raise ValueError(f"shard_stage shards over one mesh dimension; got the "
                         f"{mesh.ndim}-dimensional mesh {mesh.mesh_dim_names}: pass mesh['dp']")
    policy = mp_policy or MixedPrecisionPolicy()
    # A tensor-parallel block's output under sequence parallelism is a view (of its
    # DTensor's local part); FSDP warns in case the caller modifies it in place, which
    # the blocks of this library never do.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(\w+\) returned a view")
    units = [fully_shard(layer, mesh=mesh, reshard_after_forward=reshard_after_forward,
                         mp_policy=policy)
             for layer in stage if any(p.requires_grad for p in layer.parameters())]
    # Each backward gathers the layer before it in advance, within the micro-batch.
    # FSDP's own choice follows the order of the forwards it saw, which across a
    # pipeline's micro-batches runs on into the next micro-batch's layers: after the
    # stage's last backward it would gather a layer for a forward that never comes. The
    # first layer "prefetches" itself, already gathered: nothing (an empty list would
    # mean FSDP's own choice).
    for before, unit in zip(units[:1] + units, units):
        unit.set_modules_to_backward_prefetch([before])
    return fully_shard(stage, mesh=mesh, reshard_after_forward=reshard_after_forward,
                       mp_policy=policy)


def replicate_stage(stage: nn.Sequential, mesh: DeviceMesh,
                    mp_policy: MixedPrecisionPolicy | None = None) -> FSDPModule:
    """DDP's data parallelism for a stage whose weights are `DTensor`s (tensor
    parallel), which ``DistributedDataParallel`` refuses: PyTorch's ``replicate`` on
    FSDP's machinery, each layer a unit whose gradients are all-reduced over ``mesh``
    (averaged), the parameters whole on every replica. Driven like `shard_stage`'s
    (`start_step`, `reduce_gradients`): one all-reduce per layer per step."""
    if mesh.ndim != 1:
        raise ValueError(f"replicate_stage replicates over one mesh dimension; got the "
                         f"{mesh.ndim}-dimensional mesh {mesh.mesh_dim_names}: pass mesh['dp']")
    policy = mp_policy or MixedPrecisionPolicy()
    for layer in stage:
        if any(p.requires_grad for p in layer.parameters()):
            replicate(layer, mesh=mesh, mp_policy=policy)
    return replicate(stage, mesh=mesh, mp_policy=policy)


def start_step(stages: Iterable[FSDPModule], reshard: bool) -> None:
    """Before a step's first action: no reduce-scatter in its backwards (the gradients
    accumulate whole), and each layer's parameters freed after each forward and each
    backward (``reshard``) or kept from the first forward to the end of the step. A
    schedule with a split backward needs them kept: W works on what I left, and a
    layer resharded in between (by a forward) would free what W reads."""
    for stage in stages:
        stage.set_requires_gradient_sync(False)
        stage.set_is_last_backward(False)
        if isinstance(stage, ReplicateModule):   # whole on every replica: kept through
            stage.set_reshard_after_backward(False)   # the step (W reads them after I)
        else:
            stage.set_reshard_after_forward(reshard)
            stage.set_reshard_after_backward(reshard)


def reduce_gradients(stage: FSDPModule) -> None:
    """After ``stage``'s last backward of the step: reduce-scatter each layer's
    accumulated gradient (averaged over the replicas) into its sharded ``.grad``, and
    free the gathered parameters. What PyTorch's ``PipelineStage.perform_reduce_grad``
    does; it reaches into FSDP's state (no public call runs a post-backward)."""
    stage.set_requires_gradient_sync(True)
    stage.set_is_last_backward(True)
    # resharded: the module holds its sharded parameters again, which get the gradients
    stage.set_reshard_after_backward(True)
    state = (replicate if isinstance(stage, ReplicateModule) else fully_shard).state(stage)
    for layer_state in state._state_ctx.all_states:
        for group in layer_state._fsdp_param_groups:
            group.post_backward()
    state._root_post_backward_final_callback()
