"""A DistributedDataParallel worker for torchrun (notebook 04), beside the one-process
primitives of `pipeline_lib.course.data_parallel`.

``DistributedDataParallel`` runs one process per device for the whole training: the model
is replicated once, each process computes the loss of its own slice, and the gradients are
**averaged** by an all-reduce during the backward. `main` is such a process::

    torchrun --nproc-per-node 2 -m pipeline_lib.course.workers.data_parallel WORKDIR

trains on the batches of ``WORKDIR/ddp_setup.pt`` (`write_ddp_setup`) and leaves each
replica's final weights and losses for `read_ddp_replicas`, in ``ddp_rank{r}.pt``.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from pipeline_lib.distributed.launch import worker_device
from pipeline_lib.distributed.job import process_group
from pipeline_lib.lm.model import transformer_lm
from pipeline_lib.lm.loops import lm_loss
from pipeline_lib.course.workers import results

RESULTS = "ddp_rank"   # each process saves WORKDIR/ddp_rank{rank}.pt


def write_ddp_setup(workdir: str | Path, model_config: dict[str, Any], model: nn.Module,
                    batches: Sequence[tuple[Tensor, Tensor]], lr: float) -> Path:
    """Save what the DDP workers train: ``transformer_lm(**model_config)`` with
    ``model``'s weights, SGD at ``lr`` over ``batches`` of (inputs, targets). The
    results of an earlier job in ``workdir`` are removed."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    results.clear(workdir, RESULTS)
    path = workdir / "ddp_setup.pt"
    torch.save({"model_config": model_config, "state_dict": model.state_dict(),
                "batches": list(batches), "lr": lr}, path)
    return path


@dataclass
class Replica:
    """What one DDP process ended with."""

    state_dict: dict[str, Tensor]
    losses: list[float]   # the loss of this replica's slice, per step


def read_ddp_replicas(workdir: str | Path) -> list[Replica]:
    """What each process of the last run ended with, in rank order."""
    command = f"torchrun --nproc-per-node 2 -m {__name__} {workdir}"
    return [Replica(**saved) for saved in results.load(workdir, RESULTS, command)]


def _train(setup: dict[str, Any], device: torch.device) -> Replica:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = transformer_lm(**setup["model_config"])
    model.load_state_dict(setup["state_dict"])
    model.to(device)
    # DDP broadcasts rank 0's weights to every rank, then all-reduces gradients in buckets.
    on_gpu = device.type == "cuda"
    ddp = DistributedDataParallel(model, device_ids=[device] if on_gpu else None)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=setup["lr"])
    losses = []
    for inputs, target in setup["batches"]:
        if inputs.size(0) % world:
            raise ValueError(f"a batch of {inputs.size(0)} rows does not split evenly over "
                             f"{world} processes: DDP averages the replicas' gradients, "
                             f"which equals the whole batch's only for equal slices")
        optimizer.zero_grad(set_to_none=True)
        loss = lm_loss(ddp(inputs.tensor_split(world)[rank].to(device)),
                       target.tensor_split(world)[rank].to(device))
        loss.backward()           # the all-reduce runs here, overlapped with the backward
        optimizer.step()
        losses.append(loss.item())
    return Replica({name: t.cpu() for name, t in model.state_dict().items()}, losses)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="DistributedDataParallel (gloo on CPUs, "
                                                 "NCCL on GPUs): train the batches of "
                                                 "WORKDIR/ddp_setup.pt")
    parser.add_argument("workdir", type=Path)
    args = parser.parse_args(argv)
    if not (args.workdir / "ddp_setup.pt").exists():
        parser.error(f"{args.workdir} has no ddp_setup.pt: write it with write_ddp_setup()")
    setup = torch.load(args.workdir / "ddp_setup.pt")
    with process_group():
        results.start_run(args.workdir, RESULTS)
        replica = _train(setup, worker_device())
        results.save(args.workdir, RESULTS, vars(replica))


if __name__ == "__main__":
    main()
