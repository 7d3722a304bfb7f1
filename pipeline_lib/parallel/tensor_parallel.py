"""Tensor parallelism with PyTorch's own plans: the Transformer LM, or a pipeline stage
of it, split over the ranks of one `DeviceMesh` dimension.

`torch.distributed.tensor.parallel.parallelize_module` takes a plan, a module name ->
`ParallelStyle`, and turns each named ``nn.Linear``'s weight into a `DTensor` sharded over
the mesh, with hooks that convert its inputs and outputs. Megatron-LM's layout
(Shoeybi et al. 2019), which `by_hand` writes out:

* attention: the query, key and value projections column-parallel (`ColwiseParallel`:
  each rank computes ``heads / t`` heads), the output projection row-parallel
  (`RowwiseParallel`: each rank multiplies its heads' columns, and the partial sums are
  all-reduced);
* MLP: ``linear1`` column-parallel (``d_hid / t`` hidden units each), ``linear2``
  row-parallel (all-reduced);
* the embedding vocabulary-parallel (`RowwiseParallel` on ``nn.Embedding``: each rank
  looks up the ids in its ``V / t`` rows, zeros elsewhere, and the results are
  all-reduced); the output projection vocabulary-parallel (`ColwiseParallel`: each rank
  computes ``V / t`` of the logits), the logits left sharded for `loss_parallel`'s
  cross-entropy, or gathered (``gather_logits=True``) for any loss.

So a block all-reduces twice in its forward (after the attention and after the MLP) and
twice in its backward (the input gradients of the two column-parallel layers).

With ``sequence_parallel`` (Korthikanti et al. 2022), what every rank computed whole
between the all-reduces (the norms, the dropouts, the residual adds) is computed on
``T / t`` positions each: each all-reduce becomes a reduce-scatter (the sum, cut by
positions) and the input of the next column-parallel layer an all-gather. The same bytes
move (an all-reduce is a reduce-scatter then an all-gather), and the activations kept
between the layers shrink by t. The norms' weights stay whole on every rank; each rank's
gradient for them covers its positions only, and the plan sums them (`SequenceParallel`).
Between pipeline stages each rank then sends its own positions.

`ShardableBlock` is the block these plans can split (``nn.MultiheadAttention`` packs the
three projections into one parameter): `shardable` converts a ``transformer_lm``.
"""
from __future__ import annotations

from typing import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                               PrepareModuleOutput, RowwiseParallel,
                                               SequenceParallel, parallelize_module)
from torch.distributed.tensor.parallel.style import ParallelStyle

from pipeline_lib.lm.model import CausalBlock, Decoder, Embedding
from pipeline_lib.parallel.block import ShardableBlock, check_splits

SEQUENCE = Shard(1)   # [batch, sequence, features]: the positions split over the ranks


def block_plan(sequence_parallel: bool = False) -> dict[str, ParallelStyle]:
    """The plan of one `ShardableBlock` (names relative to it)."""
    attention = "layer.self_attn"
    plan: dict[str, ParallelStyle] = {
        # the attention's input made a DTensor once, so that the three projections'
        # input gradients add up before one all-reduce (or reduce-scatter), not one each
        attention: PrepareModuleInput(
            input_layouts=(SEQUENCE if sequence_parallel else Replicate(),),
            desired_input_layouts=(Replicate(),)),
        **{f"{attention}.{name}": ColwiseParallel() for name in ("q_proj", "k_proj", "v_proj")}}
    if not sequence_parallel:
        return {**plan, f"{attention}.out_proj": RowwiseParallel(),
                "layer.linear1": ColwiseParallel(), "layer.linear2": RowwiseParallel()}
    return {**plan,
            # its input rows are [T·B] flattened sequence first: Shard(0) splits positions
            f"{attention}.out_proj": RowwiseParallel(output_layouts=Shard(0)),
            "layer.norm1": SequenceParallel(use_local_output=True),
            "layer.linear1": ColwiseParallel(input_layouts=SEQUENCE),
            "layer.linear2": RowwiseParallel(output_layouts=SEQUENCE),
            "layer.norm2": SequenceParallel(use_local_output=True)}


def stage_plan(stage: nn.Sequential, sequence_parallel: bool = False,
               gather_logits: bool = False) -> dict[str, ParallelStyle]:
    """The plan of ``stage``, consecutive layers of a ``transformer_lm`` laid out by
    `shardable` (the whole model is one stage). A stage's input and output are the
    whole activation, or under ``sequence_parallel`` this rank's positions of it: the
    embedding's sum is all-reduced (its positional table and dropout act on every
    position), then each rank keeps its own positions (their gradients all-gathered back
    in the backward), wherever the stage ends."""
    plan: dict[str, ParallelStyle] = {}
    for name, layer in stage.named_children():
        if isinstance(layer, CausalBlock):
            raise TypeError(f"layer {name} is a CausalBlock, whose attention packs its "
                            f"projections in one parameter: lay the model out with "
                            f"pipeline_lib.parallel.block.shardable(model) first")
        if isinstance(layer, Embedding):
            # output whole (all-reduced): the positional table and dropout follow it
            plan[f"{name}.tokens"] = RowwiseParallel(input_layouts=Replicate())
            if sequence_parallel:   # then this rank's positions
                plan[name] = PrepareModuleOutput(output_layouts=Replicate(),
                                                 desired_output_layouts=SEQUENCE)
        elif isinstance(layer, ShardableBlock):
            plan.update({f"{name}.{key}": style
                         for key, style in block_plan(sequence_parallel).items()})
        elif isinstance(layer, Decoder):
            plan[f"{name}.linear"] = ColwiseParallel(
                input_layouts=SEQUENCE if sequence_parallel else Replicate(),
                output_layouts=Replicate() if gather_logits else Shard(-1),
                use_local_output=gather_logits)
    return plan


def tensor_parallel(stage: nn.Sequential, mesh: DeviceMesh, sequence_parallel: bool = False,
                    gather_logits: bool = False) -> nn.Sequential:
    """Split ``stage`` over the one-dimensional ``mesh`` (a tensor-parallel group, e.g.
    ``mesh["tp"]``) in place with `stage_plan`, and return it. Every rank of ``mesh``
    must hold the same weights before (build with the same seed, or load one state dict).
    Without ``gather_logits``, a stage holding the decoder returns logits sharded over the
    vocabulary: compute the loss and its backward under
    ``torch.distributed.tensor.parallel.loss_parallel()``."""
    if mesh.ndim != 1:
        raise ValueError(f"tensor_parallel splits over one mesh dimension; got a "
                         f"{mesh.ndim}-dimensional mesh {mesh.mesh_dim_names}: pass "
                         f"mesh['tp']")
    rank, ranks = mesh.get_local_rank(), mesh.size()
    for layer in stage:
        if isinstance(layer, ShardableBlock):
            check_splits(layer, ranks)
    plan = stage_plan(stage, sequence_parallel, gather_logits)
    if not plan:   # else every rank would compute the whole stage, and tp split nothing
        kinds = sorted({type(layer).__name__ for layer in stage})
        raise ValueError(f"tensor parallelism splits a transformer_lm's Embedding, blocks "
                         f"and Decoder; this stage holds none of them ({', '.join(kinds)}), "
                         f"so its {ranks} tensor-parallel ranks would each compute all of "
                         f"it: run it with tp=1, or build the model with transformer_lm")
    parallelize_module(stage, mesh, plan)
    for layer in stage:
        if isinstance(layer, ShardableBlock):
            layer.layer.self_attn.tp_rank, layer.layer.self_attn.tp = rank, ranks
            layer.sequence_parallel = sequence_parallel
    return stage


def sum_partial_gradients(parameters: Iterable[nn.Parameter]) -> None:
    """Under sequence parallelism the gradients of the weights every rank holds whole
    (the norms', the row-parallel layers' biases) are each rank's share, computed from
    its own positions: ``Partial`` `DTensor`\\ s that PyTorch sums when first read, one
    all-reduce each. Sum them now, once a step, in one all-reduce per mesh (as
    Megatron-LM sums its norms' gradients): then the optimizer, the gradient clipping
    and the checkpoints read plain values. (Replicas under FSDP or ``replicate`` get
    them summed by their reduction already.)"""
    partial: dict[DeviceMesh, list[nn.Parameter]] = {}
    for p in parameters:
        grad = p.grad
        if isinstance(grad, DTensor) and any(isinstance(pl, Partial) for pl in grad.placements):
            partial.setdefault(grad.device_mesh, []).append(p)
    for mesh, params in partial.items():
        if mesh.ndim != 1:
            raise NotImplementedError(f"partial gradients on a {mesh.ndim}-dimensional mesh")
        locals_ = [p.grad.to_local() for p in params]
        flat = torch.cat([t.reshape(-1) for t in locals_])
        dist.all_reduce(flat, group=mesh.get_group())
        for p, part in zip(params, flat.split([t.numel() for t in locals_])):
            placements = [Replicate() if isinstance(pl, Partial) else pl
                          for pl in p.grad.placements]
            p.grad = DTensor.from_local(part.view_as(p.grad.to_local()), mesh, placements,
                                        run_check=False)
