"""Where stages live and how tensors move between them.

Between two GPUs an activation is copied on a side stream of the receiving GPU, so the
copy overlaps with the computation running on both devices' compute streams.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

_copy_streams: dict[torch.device, "torch.cuda.Stream"] = {}


def module_device(module: nn.Module, default: torch.device) -> torch.device:
    """The device of a module's first parameter or buffer; ``default`` if it has none."""
    for t in list(module.parameters()) + list(module.buffers()):
        return t.device
    return default


def transfer(value: Any, device: torch.device) -> Any:
    """Move a tensor (or the tensors of a tuple) to ``device``; other values pass."""
    if isinstance(value, tuple):
        return tuple(transfer(v, device) for v in value)
    if not isinstance(value, Tensor) or value.device == device:
        return value
    if value.is_cuda and device.type == "cuda":
        stream = _copy_streams.setdefault(device, torch.cuda.Stream(device))
        stream.wait_stream(torch.cuda.current_stream(value.device))
        with torch.cuda.stream(stream):
            moved = value.to(device, non_blocking=True)
        value.record_stream(stream)   # keep the source alive until the copy has run
        torch.cuda.current_stream(device).wait_stream(stream)
        return moved
    return value.to(device)
