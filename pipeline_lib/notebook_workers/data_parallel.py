"""Data parallelism, spelled out: the four primitives of ``torch.nn.parallel`` on CPU, and
a DistributedDataParallel worker for torchrun.

``nn.DataParallel`` runs one training step as four moves, all from one process:

* `replicate`: copy the module onto every device;
* `scatter`: split the batch along dim 0, one slice per device;
* `parallel_apply`: run each replica on its slice, one thread per device;
* `parallel_gather` (``torch.nn.parallel.gather``): concatenate the outputs on one
  device, where the loss is computed.

Its backward flows back through the gather to every replica, and the replicas' gradients
are **summed** into the original module's (`reduce_gradients`). PyTorch's versions need
CUDA devices; these do the same with CPU "devices": a replica is a deep copy, and threads
run in parallel because PyTorch releases the GIL inside its kernels.

``DistributedDataParallel`` instead runs one process per device for the whole training:
the model is replicated once, each process computes the loss of its own slice, and the
gradients are **averaged** by an all-reduce during the backward. `main` is such a process::

    torchrun --nproc-per-node 2 -m pipeline_lib.notebook_workers.data_parallel WORKDIR

trains on the batches of ``WORKDIR/ddp_setup.pt`` (`write_ddp_setup`) and leaves each
replica's final weights and losses for `read_ddp_replicas`, in ``ddp_rank{r}.pt``.
"""
from __future__ import annotations

import argparse
import copy
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from pipeline_lib.distributed.launch import worker_device
from pipeline_lib.distributed.job import process_group
from pipeline_lib.lm.model import transformer_lm
from pipeline_lib.lm.loops import lm_loss
from pipeline_lib.notebook_workers import results

Device = torch.device | str
RESULTS = "ddp_rank"   # each process saves WORKDIR/ddp_rank{rank}.pt


# -- DataParallel's four primitives ---------------------------------------------------

def replicate(module: nn.Module, devices: Sequence[Device]) -> list[nn.Module]:
    """One copy of ``module`` per device, parameters and buffers included."""
    return [copy.deepcopy(module).to(device) for device in devices]


def scatter(inputs: Tensor, devices: Sequence[Device]) -> list[Tensor]:
    """Split ``inputs`` along dim 0 and move slice i to ``devices[i]``.

    Like ``torch.nn.parallel.scatter`` the slices come from ``Tensor.chunk``: equal
    slices of ceil(rows / devices) rows, so a small batch gives fewer slices than devices
    (5 rows on 4 devices: 2, 2, 1) and the last devices then sit idle.
    """
    if inputs.dim() == 0 or inputs.size(0) == 0:
        raise ValueError(f"scatter splits along dim 0, which needs at least one row; got "
                         f"a tensor of shape {tuple(inputs.shape)}")
    chunks = inputs.chunk(len(devices))
    return [chunk.to(device) for chunk, device in zip(chunks, devices)]


def parallel_apply(modules: Sequence[Callable[[Any], Any]],
                   inputs: Sequence[Any]) -> list[Any]:
    """``modules[i](inputs[i])`` for every i at once, one thread each (any callables do:
    `multi_device_loss` runs a loss-and-backward function per device).

    An exception in any thread is raised here, naming the replica, once all have
    finished: none is left running.
    """
    if len(modules) != len(inputs):
        raise ValueError(f"got {len(modules)} modules for {len(inputs)} inputs; "
                         f"parallel_apply runs module i on input i")
    results: list[Any] = [None] * len(modules)
    errors: list[tuple[int, BaseException]] = []
    grad_enabled = torch.is_grad_enabled()   # a per-thread setting: carry it over

    def work(i: int) -> None:
        try:
            with torch.set_grad_enabled(grad_enabled):
                results[i] = modules[i](inputs[i])
        except BaseException as error:  # noqa: BLE001 - re-raised in the caller below
            errors.append((i, error))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(modules))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        i, error = min(errors, key=lambda e: e[0])
        raise RuntimeError(f"replica {i} failed: {error!r}") from error
    return results


def parallel_gather(outputs: Sequence[Tensor], device: Device) -> Tensor:
    """``torch.nn.parallel.gather``: concatenate the replicas' outputs along dim 0 on
    ``device``; autograd sends each replica its part of the gradient back through the
    concatenation."""
    return torch.cat([out.to(device) for out in outputs])


def reduce_gradients(replicas: Sequence[nn.Module], module: nn.Module) -> None:
    """Add the sum of the replicas' gradients to ``module``'s (what DataParallel's
    backward does through its broadcast): the loss was computed on the gathered batch,
    so each replica holds the gradient of its own rows' share, and the shares add up."""
    for param, *copies in zip(module.parameters(), *(r.parameters() for r in replicas)):
        grads = [c.grad.to(param.device) for c in copies if c.grad is not None]
        if grads:
            total = torch.stack(grads).sum(0)
            param.grad = total if param.grad is None else param.grad + total


def data_parallel_step(module: nn.Module, inputs: Tensor, target: Tensor,
                       loss_fn: Callable[[Tensor, Tensor], Tensor],
                       devices: Sequence[Device]) -> Tensor:
    """One forward and backward of ``nn.DataParallel``, from the four primitives.

    ``module``'s gradients accumulate exactly as ``loss_fn(module(inputs), target)
    .backward()`` would. Returns the loss, detached.
    """
    slices = scatter(inputs, devices)
    replicas = replicate(module, devices[:len(slices)])
    output = parallel_gather(parallel_apply(replicas, slices), devices[0])
    loss = loss_fn(output, target.to(devices[0]))
    loss.backward()
    reduce_gradients(replicas, module)
    return loss.detach()


# -- DistributedDataParallel: one process per replica -------------------------------

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
