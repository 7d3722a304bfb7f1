"""Tensor parallelism, sharded data parallelism and the pipeline on all three, recorded
rank by rank: the torchrun job of notebook 08.

    torchrun --nproc-per-node 8 -m pipeline_lib.course.workers.three_dimensions WORKDIR

``WORKDIR/setup.pt`` (`write_setup`) holds the job: the model's config and weights, an
input for one block, a batch and its micro-batch count. The 8 ranks form a ``tp × pp ×
dp = 2 × 2 × 2`` mesh in Megatron-LM's order (`MESH`: ``init_mesh``), used three ways:

* the **tensor-parallel** group of rank 0 (`TP_RANKS`): the model's first block split
  over it by hand (`parallel.by_hand`) and by PyTorch's plan (`parallel.tensor_parallel`),
  with and without sequence parallelism: each way's output, input gradient, weight
  gradients (gathered whole), the messages of its forward and of its backward, the bytes
  autograd saved for the backward, and its dropout masks;
* the **data-parallel** group of rank 0 (`DP_RANKS`): one step of the whole model run
  as one pipeline stage (its micro-batches in 1F1B's order) replicated with DDP, and
  sharded with FSDP (resharded after forward, and not): gradients gathered whole, the
  step's messages, and the bytes each rank keeps between steps for parameters,
  gradients and Adam's states;
* all 8 ranks: the **executor**, `DistributedPipe` on the mesh (1F1B, each stage
  tensor-parallel, the replicas as DDP), two steps of the batch (the first agrees the
  messages' layouts): the second's loss, its gradients gathered whole, and its messages
  on each mesh dimension.

Each rank saves a record (``WORKDIR/rank{r}.pt``); `read_records` loads them in rank
order.
"""
from __future__ import annotations

import argparse
import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel
from torch.utils._python_dispatch import TorchDispatchMode

from pipeline_lib.course.workers import results
from pipeline_lib.distributed import DistributedPipe
from pipeline_lib.distributed.job import process_group
from pipeline_lib.distributed.mesh import Mesh, init_mesh
from pipeline_lib.parallel import rank_order
from pipeline_lib.lm.loops import lm_loss
from pipeline_lib.lm.model import transformer_lm
from pipeline_lib.parallel.block import ShardableBlock, shardable
from pipeline_lib.parallel.by_hand import split_block
from pipeline_lib.parallel.fsdp import reduce_gradients, shard_stage, start_step
from pipeline_lib.parallel.tensor_parallel import tensor_parallel
from pipeline_lib.parallel.traffic import Message, Traffic
from pipeline_lib.rng import owned_rng
from pipeline_lib.stage import StageRunner
from pipeline_lib.step import split_batch

RESULTS = "rank"
MESH, ORDER = {"tp": 2, "pp": 2, "dp": 2}, rank_order.MEGATRON
RANKS = MESH["tp"] * MESH["pp"] * MESH["dp"]
TP_RANKS = rank_order.groups("tp", ORDER, MESH)[0]      # rank 0's groups
DP_RANKS = rank_order.groups("dp", ORDER, MESH)[0]
ONE_F_ONE_B = [("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("F", 3), ("B", 2),
               ("B", 3)]   # a stage's actions in 1F1B's order, 4 micro-batches


@dataclass
class Setup:
    """One job; every rank reads the same."""

    model_config: dict[str, Any]          # transformer_lm(**model_config)
    state_dict: dict[str, Tensor]         # its weights
    block_input: Tensor                   # [B, T, d_model]: what the first block is fed
    dropout: float                        # for the masks' record: the block's dropout
    batch: tuple[Tensor, Tensor]          # (inputs, targets) of the steps
    microbatches: int = 4                 # of the executor's step (per replica)


def write_setup(workdir: str | Path, setup: Setup) -> Path:
    """Save the job; an earlier job's records in ``workdir`` are removed."""
    return results.write_setup(workdir, RESULTS, setup)


def read_records(workdir: str | Path) -> list[dict[str, Any]]:
    """Every rank's record, in rank order (its messages as `traffic.Message`\\ s)."""
    command = f"torchrun --nproc-per-node {RANKS} -m {__name__} {workdir}"
    with torch.serialization.safe_globals([Message]):
        return results.load(workdir, RESULTS, command)


def build(setup: Setup, dropout: float = 0.0) -> nn.Sequential:
    """The model with the setup's weights, laid out for splitting."""
    model = transformer_lm(**{**setup.model_config, "dropout": dropout})
    model.load_state_dict(setup.state_dict)
    return shardable(model)


def block_loss(out: Tensor) -> Tensor:
    """A loss on a block's output whose gradient is not nearly zero (the sum of squares
    after a LayerNorm is nearly constant)."""
    return out.pow(3).sum()


def whole(t: Tensor) -> Tensor:
    """A tensor as one process holds it (a DTensor gathered), on the CPU."""
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu()


def gathered_grads(split: ShardableBlock, group: dist.ProcessGroup) -> dict[str, Tensor]:
    """A block split by hand's gradients, gathered whole, by the unsplit block's names:
    column-parallel pieces joined by rows, row-parallel weights by columns; the others
    are whole on every rank."""
    out = {}
    for name, p in split.named_parameters():
        name = name.replace(".norm.", ".")
        dim = (0 if any(k in name for k in ("q_proj", "k_proj", "v_proj", "linear1"))
               else 1 if name.endswith(("out_proj.weight", "linear2.weight")) else None)
        if dim is None:
            out[name] = whole(p.grad)
            continue
        parts = [torch.empty_like(p.grad) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, p.grad.contiguous(), group=group)
        out[name] = whole(torch.cat(parts, dim))
    return out


class SavedBytes(torch.autograd.graph.saved_tensors_hooks):
    """Bytes autograd saves for the backward in the block, each storage once, the
    module's parameters not counted; a DTensor's by its local part on this rank.
    (`memory.SavedActivations` does this per stage for plain tensors.)"""

    def __init__(self, module: nn.Module) -> None:
        self.bytes, self.seen = 0, {_local(p).untyped_storage().data_ptr()
                                    for p in module.parameters()}
        super().__init__(self._pack, lambda t: t)

    def __enter__(self) -> "SavedBytes":
        super().__enter__()
        return self

    def _pack(self, t: Tensor) -> Tensor:
        storage = _local(t).untyped_storage()
        if storage.data_ptr() not in self.seen:
            self.seen.add(storage.data_ptr())
            self.bytes += storage.nbytes()
        return t


def _local(t: Tensor) -> Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class Masks(TorchDispatchMode):
    """Every dropout mask drawn in the block (``bernoulli_``'s output), in order."""

    def __init__(self) -> None:
        super().__init__()
        self.masks: list[Tensor] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.bernoulli_.float:
            self.masks.append(out.detach().cpu().clone())
        return out


def _split(way: str, block: ShardableBlock, mesh, sequence_parallel: bool) -> nn.Module:
    if way == "hand":
        return split_block(block, mesh.get_group(), sequence_parallel)
    return tensor_parallel(nn.Sequential(copy.deepcopy(block)), mesh, sequence_parallel)


def tensor_parallel_record(setup: Setup, mesh, device: torch.device) -> dict[str, Any]:
    """The first block split over the group, both ways, with and without sequence
    parallelism (see the module docstring)."""
    rank, ranks = mesh.get_local_rank(), mesh.size()
    record: dict[str, Any] = {}
    for sp in (False, True):
        x = setup.block_input.to(device)
        x = x.chunk(ranks, 1)[rank] if sp else x
        for way in ("hand", "plan"):
            split = _split(way, build(setup)[1].to(device), mesh, sp)
            given = x.clone().requires_grad_()
            with Traffic({"tp": mesh.get_group()}) as forward, SavedBytes(split) as saved:
                out = split(given)
            with Traffic({"tp": mesh.get_group()}) as backward:
                block_loss(out).backward()
            grads = (gathered_grads(split, mesh.get_group()) if way == "hand" else
                     {n.split(".", 1)[1]: whole(p.grad) for n, p in split.named_parameters()})
            dropped = _split(way, build(setup, setup.dropout)[1].to(device), mesh, sp)
            with owned_rng(5), Masks() as masks:
                dropped(x)
            record[(way, sp)] = dict(
                out=whole(out), input_grad=whole(given.grad), grads=grads,
                forward=forward.messages, backward=backward.messages,
                saved_bytes=saved.bytes, masks=masks.masks)
    return record


def run_stage(model: nn.Module, actions: Sequence[tuple[str, int]],
              batch: tuple[Tensor, Tensor], microbatches: int, replica: int, replicas: int,
              arm: Callable[[], None] = lambda: None) -> None:
    """One step of ``model`` run as one pipeline stage (the first and the last), its
    ``actions`` (("F", i), ("B", i), or a split backward's ("I", i) and ("W", i)) in a
    schedule's order, on replica ``replica``'s rows of ``batch``; ``arm`` runs just
    before the last backward (where DDP's all-reduce is armed)."""
    inputs, targets = batch
    micro_in, micro_target, weights = split_batch(inputs, targets, microbatches, replicas,
                                                  replica)
    device = next(model.parameters()).device
    runner = StageRunner(0, model, device, "never", microbatches, 7, loss_fn=lm_loss,
                         loss_weights=weights, input_as_given=True, rng=owned_rng)
    last = max(k for k, (kind, _) in enumerate(actions) if kind in ("B", "W"))
    for k, (kind, i) in enumerate(actions):
        if k == last:
            arm()
        if kind == "F":
            runner.forward(i, micro_in[i].to(device), micro_target[i].to(device))
        elif kind == "B":
            runner.backward(i)
        elif kind == "I":
            runner.backward_input(i)
        else:
            runner.backward_weight(i)


def _bytes_held(tensors: Sequence[Tensor | None]) -> int:
    """Bytes of this rank's part of ``tensors`` (a DTensor's local shard)."""
    return sum((t.to_local() if isinstance(t, DTensor) else t).nbytes
               for t in tensors if t is not None)


def data_parallel_record(setup: Setup, mesh, device: torch.device) -> dict[str, Any]:
    """One step with DDP, with FSDP resharded after forward (ZeRO-3) and with FSDP
    keeping the parameters gathered through the step; then one Adam step each."""
    replica, replicas, group = mesh.get_local_rank(), mesh.size(), mesh.get_group()
    record: dict[str, Any] = {}
    for mode in ("ddp", "fsdp", "fsdp-keep"):
        model = build(setup).to(device)
        reshard = mode == "fsdp"
        if mode == "ddp":   # construction broadcasts rank 0's weights: not the step's
            model = DistributedDataParallel(model, process_group=group,
                                            broadcast_buffers=False)
        else:
            model = shard_stage(model, mesh, reshard_after_forward=reshard)
        with Traffic({"dp": group}) as traffic:
            if mode == "ddp":
                with model.no_sync():   # all-reduce armed for the last backward only
                    run_stage(model, ONE_F_ONE_B, setup.batch, 4, replica, replicas,
                              arm=lambda: model.reducer.prepare_for_backward([]))
            else:
                start_step([model], reshard)
                run_stage(model, ONE_F_ONE_B, setup.batch, 4, replica, replicas)
                reduce_gradients(model)
        params = list(model.parameters())
        grads = {n.removeprefix("module."): whole(p.grad) for n, p in model.named_parameters()}
        held = dict(parameters=_bytes_held(params), gradients=_bytes_held([p.grad for p in params]))
        optimizer = torch.optim.Adam(params)
        optimizer.step()
        held["adam"] = _bytes_held([t for state in optimizer.state.values()
                                    for t in state.values() if t.dim() > 0])
        record[mode] = dict(grads=grads, messages=traffic.messages, held=held)
    return record


def pipeline_record(setup: Setup, mesh: Mesh) -> dict[str, Any]:
    """`DistributedPipe` on the whole mesh: the second step's loss, gradients (whole, by
    ``build(setup)``'s names) and messages (see the module docstring)."""
    model = transformer_lm(**setup.model_config)
    model.load_state_dict(setup.state_dict)
    balance = [len(model) // mesh.pp] * mesh.pp
    pipe = DistributedPipe(model, mesh, balance, setup.microbatches, "1f1b")
    pipe.step(*setup.batch, lm_loss)   # the messages' layouts agreed: a steady step next
    for p in pipe.parameters():
        p.grad = None
    with Traffic({"tp": mesh.tp_group, "dp": mesh.dp_group,
                  "pp": list(mesh.channels.values())}) as traffic:
        loss = pipe.step(*setup.batch, lm_loss)
    first = mesh.pipe_rank * balance[0]
    grads = {}
    for s, module in pipe.modules.items():
        for name, p in module.named_parameters():
            layer, rest = name.split(".", 1)
            grads[f"{first + int(layer)}.{rest}"] = whole(p.grad)
    return dict(loss=None if loss is None else loss.item(), grads=grads,
                messages=traffic.messages,
                place=dict(tp=mesh.tp_rank, pp=mesh.pipe_rank, dp=mesh.replica))


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Split a block over the ranks by hand and "
                                     "by PyTorch's plan, shard a stage with FSDP, and run "
                                     "the pipeline on all three dimensions; record what "
                                     "each rank did")
    parser.add_argument("workdir", type=Path)
    parser.add_argument("--timeout", type=float, default=120.0)
    args = parser.parse_args(argv)
    setup = Setup(**torch.load(args.workdir / "setup.pt"))
    with process_group(timeout=args.timeout):
        mesh = init_mesh(MESH["pp"], MESH["dp"], args.timeout, ORDER, tp=MESH["tp"])
        results.start_run(args.workdir, RESULTS)
        record: dict[str, Any] = {}
        if mesh.rank in TP_RANKS:
            record["tp"] = tensor_parallel_record(setup, mesh.device_mesh["tp"], mesh.device)
        if mesh.rank in DP_RANKS:
            record["dp"] = data_parallel_record(setup, mesh.device_mesh["dp"], mesh.device)
        record["pipe"] = pipeline_record(setup, mesh)
        results.save(args.workdir, RESULTS, record)


if __name__ == "__main__":
    main()
