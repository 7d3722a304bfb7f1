"""Data parallelism, spelled out: the four primitives of ``torch.nn.parallel``, on any
devices (CPU "devices" included).

``nn.DataParallel`` runs one training step as four moves, all from one process:

* `replicate`: copy the module onto every device;
* `scatter`: split the batch along dim 0, one slice per device;
* `parallel_apply`: run each replica on its slice, one thread per device;
* `parallel_gather` (``torch.nn.parallel.gather``): concatenate the outputs on one
  device, where the loss is computed.

Its backward flows back through the gather to every replica, and the replicas' gradients
are **summed** into the original module's (`reduce_gradients`). PyTorch's versions need
CUDA devices; these do the same with CPU "devices": a replica is a deep copy, and threads
run in parallel because PyTorch releases the GIL inside its kernels. Notebook 04 teaches
them; `pipeline_lib.lm.multi_device_loss` builds on them.
"""
from __future__ import annotations

import copy
import threading
from typing import Any, Callable, Sequence

import torch
from torch import Tensor, nn

from pipeline_lib.thread_state import ThreadState

Device = torch.device | str


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

    Each thread runs under the caller's thread-local modes: ``torch.autocast``,
    ``saved_tensors_hooks`` (``save_on_cpu``), grad mode and the intra-op thread count
    (`pipeline_lib.thread_state`). An exception in any thread is raised here, naming the
    replica, once all have finished: none is left running.
    """
    if len(modules) != len(inputs):
        raise ValueError(f"got {len(modules)} modules for {len(inputs)} inputs; "
                         f"parallel_apply runs module i on input i")
    results: list[Any] = [None] * len(modules)
    errors: list[tuple[int, BaseException]] = []
    # grad mode, autocast, saved-tensor hooks and the thread count are per thread: each
    # replica computes under the caller's (`thread_state`)
    modes = ThreadState.capture()

    def work(i: int) -> None:
        try:
            with modes.applied():
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
