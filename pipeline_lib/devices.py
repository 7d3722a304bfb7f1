"""Where stages live and how tensors move between them.

A stage lives where its parameters are, unless a layer in it is wrapped in `WithDevice`;
a stage without parameters stays on the previous stage's device. Between two GPUs an
activation is copied on a side stream of each GPU, so the copy overlaps with the
computation running on both devices' compute streams. From the CPU to a GPU a tensor is
copied from page-locked ("pinned") memory without blocking: a copy from ordinary
(pageable) memory makes the host wait while the driver stages it, and the host is what
keeps the GPU's queue full. A step pins its micro-batches once (`pinned`); `read_back`
is the one read of a device tensor a step makes, at its end.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import Tensor, nn

from pipeline_lib import tree

_side_streams: dict[torch.device, "torch.cuda.Stream"] = {}


def indexed(device: torch.device | str) -> torch.device:
    """``device`` with its index: "cuda" means the current GPU, where ``.to("cuda")``
    puts tensors. Index-less, it would never equal a tensor's device ("cuda:0"), so
    `transfer` would copy every time, and ``torch.cuda.set_device`` refuses it."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


class WithDevice(nn.Module):
    """Pin ``module`` (and the stage it lands in) to ``device``.

    Without it a `Pipe` places a stage where its parameters already are, and a stage with
    none (an activation, a reshape, a loss head) where the stage before it is; wrap a
    layer to choose instead, e.g. to balance memory: ``WithDevice(nn.Dropout(0.1),
    "cuda:1")``. The wrapper is transparent: it calls ``module`` and holds it as
    ``.module``.
    """

    def __init__(self, module: nn.Module, device: torch.device | str):
        super().__init__()
        self.module, self.device = module, torch.device(device)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def extra_repr(self) -> str:
        return f"device={self.device}"


def pinned_device(module: nn.Module) -> torch.device | None:
    """The device that `WithDevice` wrappers inside ``module`` ask for, if any."""
    pinned = {indexed(m.device) for m in module.modules() if isinstance(m, WithDevice)}
    if len(pinned) > 1:
        raise ValueError(f"one stage holds layers pinned by WithDevice to different devices "
                         f"{sorted(map(str, pinned))}; a stage runs on one device, so split "
                         f"them into different stages (see Pipe's balance)")
    return pinned.pop() if pinned else None


def module_device(module: nn.Module, default: torch.device) -> torch.device:
    """Where a stage goes: its `WithDevice` pin, else the device of its first parameter or
    buffer, else ``default``."""
    pinned = pinned_device(module)
    if pinned is not None:
        return pinned
    for t in list(module.parameters()) + list(module.buffers()):
        return t.device
    return default


def stage_devices(stages: Sequence[nn.Module],
                  devices: Sequence[torch.device | str] | None) -> list[torch.device]:
    """One indexed device per stage: ``devices`` checked against the stages' `WithDevice`
    pins, or, when None, found with `module_device`, each stage defaulting to the
    previous one's."""
    if devices is None:
        found, previous = [], torch.device("cpu")
        for stage in stages:
            previous = module_device(stage, previous)
            found.append(previous)
        return found
    if len(devices) != len(stages):
        raise ValueError(f"got {len(devices)} devices for {len(stages)} stages; give "
                         f"one device per stage (stages may share a device)")
    devices = [indexed(d) for d in devices]
    for s, (stage, device) in enumerate(zip(stages, devices)):
        if device.type == "cuda" and device.index >= torch.cuda.device_count():
            raise ValueError(f"devices[{s}] is {device}, but this machine has "
                             f"{torch.cuda.device_count()} GPU(s); give cuda:0 to "
                             f"cuda:{torch.cuda.device_count() - 1}")
        pinned = pinned_device(stage)
        if pinned is not None and pinned != device:
            raise ValueError(f"stage {s} holds a layer pinned by WithDevice to {pinned}, "
                             f"but devices[{s}] is {device}; make them agree or drop one")
    return devices


def side_stream(device: torch.device) -> "torch.cuda.Stream":
    """The one copy stream of a GPU, made on first use (a stream per copy would cost a
    driver call each time, and its copies would not be ordered with the earlier ones)."""
    if device not in _side_streams:
        _side_streams.setdefault(device, torch.cuda.Stream(device))
    return _side_streams[device]


def pinned(value: Any) -> Any:
    """``value`` (a tensor or a tree of them) with its CPU tensors in page-locked memory,
    so that `transfer` copies them to a GPU without making the host wait. A step pins
    its micro-batches once, rather than each message pinning its own copy."""
    return tree.map_tensors(
        lambda t: t.pin_memory() if t.device.type == "cpu" and not t.is_pinned() else t, value)


def read_back(values: Tensor) -> list[Any]:
    """``values.tolist()``, for the one read of the device a step makes, at its end.

    On a GPU the values come through page-locked memory, and the host waits for an
    event recorded after that copy: for the work queued before it on this stream, and
    no other. A step calls it once the executor has waited for its ranks' last events,
    so the device has nothing left to do for it: the wait is free. (``.tolist()`` would
    wait for the same work, but through a synchronising copy, which
    ``torch.cuda.set_sync_debug_mode`` reports as a stall.)"""
    if values.device.type != "cuda":
        return values.tolist()
    host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
    host.copy_(values, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record(torch.cuda.current_stream(values.device))
    copied.synchronize()
    return host.tolist()


def transfer(value: Any, device: torch.device) -> Any:
    """Move a tensor (or every tensor of a tree, `pipeline_lib.tree`) to ``device``; other
    values pass.

    Between GPUs the copy runs on the side streams of both (PyTorch runs a peer copy on
    the source GPU's current stream; the target's current stream waits for it), after
    what the source's compute stream queued so far, and the target's compute stream
    waits for it. The caching allocator hands a freed block to the next request on the
    stream that allocated it, without waiting for work queued on other streams; so each
    tensor is recorded on the stream that uses it but did not allocate it, as
    torchgpipe's copy.py does: the source (allocated on its compute stream) on the
    source's side stream, which reads it; the copy (allocated on the target's side
    stream) on the target's compute stream, which reads it after we return. Without the
    second, the next copy could land in the block that the compute stream still reads.

    From the CPU to a GPU the copy runs on the target's current stream (the stage's,
    which reads it next), from page-locked memory and without blocking the host (a
    tensor that `pinned` did not pin is pinned here first); the caching host allocator
    keeps the page-locked block until the copy is done.
    """
    if not isinstance(value, Tensor):
        return tree.map_tensors(lambda t: transfer(t, device), value)
    if value.device == device:
        return value
    if value.device.type == "cpu" and device.type == "cuda":
        return pinned(value).to(device, non_blocking=True)
    if not (value.is_cuda and device.type == "cuda"):
        return value.to(device)
    source, target = side_stream(value.device), side_stream(device)
    compute = torch.cuda.current_stream(device)
    source.wait_stream(torch.cuda.current_stream(value.device))
    with torch.cuda.stream(source), torch.cuda.stream(target):
        moved = value.to(device, non_blocking=True)
    value.record_stream(source)
    moved.record_stream(compute)
    compute.wait_stream(target)
    return moved
