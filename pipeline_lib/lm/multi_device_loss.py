"""The Annotated Transformer's ``MultiGPULossCompute``: the chunked loss, spread over devices.

`chunked_loss.chunked_loss_backward` shrinks the logits alive at once from T positions
to ``chunk``, but one device still does all the rows. The Annotated Transformer (Rush,
2018) splits the work of its vocabulary projection (the "generator") and loss both ways,
rows over devices and positions into chunks, and `multi_device_loss_backward` retells it
with this library's pieces:

1. cut the features (the body's output) off their graph and **scatter** them and the
   targets by rows, one slice per device (`data_parallel.scatter`: 5 rows on 2 devices
   are 3 + 2);
2. **replicate** the generator onto each device;
3. on every device at once, one thread each, run `chunked_loss_backward` on its rows:
   chunk by chunk of positions, each chunk backpropagated at once into the rows' slice
   and the device's replica;
4. **gather**: add the devices' losses on the first device, concatenate the slices'
   gradients into the features' gradient and backpropagate the body once from it, and
   sum the replicas' weight gradients into the generator (`reduce_gradients`).

Why plain sums are right: every device divides its token losses by the real-token count
of the *whole* batch, not its own, so the devices' losses and gradients are shares of one
mean. Averaging the devices' own means instead would weigh a token by how few rows (or
how much padding) its device got. A device holds at most ``ceil(B / devices) x chunk``
positions of logits at a time, against ``B x T`` for the plain loss on one device.
"""
from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Sequence

import torch
from torch import Tensor, nn

from pipeline_lib.course.data_parallel import (Device, parallel_apply, reduce_gradients,
                                        replicate, scatter)
from pipeline_lib.lm.chunked_loss import (IGNORE_INDEX, check_loss_inputs,
                                          chunked_loss_backward, counted_tokens)


def multi_device_loss_backward(features: Tensor, generator: nn.Module, target: Tensor,
                               devices: Sequence[Device], chunk: int, *,
                               ignore_index: int = IGNORE_INDEX,
                               watch: Sequence[AbstractContextManager] | None = None
                               ) -> Tensor:
    """Backward the mean cross-entropy of ``generator(features)`` against ``target``, its
    rows split over ``devices`` and each device's positions in slices of ``chunk``; then
    once through whatever computed ``features``. Returns the loss, detached, on
    ``devices[0]``.

    Gradients accumulate into ``generator`` and the body exactly as the plain loss's
    ``.backward()`` would. ``watch[i]``, if given, is entered around device i's work on
    its thread, e.g. a `pipeline_lib.memory.PeakTensorMemory` per device to measure each
    device's peak (its ``peak`` stays 0 if the batch has fewer rows than devices).
    """
    if not devices:
        raise ValueError("devices is empty: pass at least one, e.g. "
                         "[torch.device('cpu')] * 2 for two CPU 'devices'")
    if watch is not None and len(watch) != len(devices):
        raise ValueError(f"got {len(watch)} context managers to watch {len(devices)} "
                         f"devices: pass one per device")
    check_loss_inputs(features, target, chunk)
    tokens = counted_tokens(target, ignore_index)
    rows = [piece.requires_grad_(features.requires_grad)      # each a leaf on its device
            for piece in scatter(features.detach(), devices)]
    targets = scatter(target, devices)
    replicas = replicate(generator, devices[:len(rows)])

    def device_loss(i: int) -> Tensor:
        with watch[i] if watch is not None else nullcontext():
            return chunked_loss_backward(rows[i], replicas[i], targets[i], chunk,
                                         ignore_index=ignore_index, tokens=tokens)

    losses = parallel_apply([device_loss] * len(rows), range(len(rows)))
    reduce_gradients(replicas, generator)
    if features.requires_grad:
        features.backward(torch.cat([piece.grad.to(features.device) for piece in rows]))
    return sum(loss.to(devices[0]) for loss in losses)
