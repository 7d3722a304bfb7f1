"""``torch.distributed.pipeline.sync._balance``: `balance_by_time` with its classic
signature, ``balance_by_time(partitions, module, sample, *, timeout, device)``.

It measures with `pipeline_lib.partition.layer_times` and splits with
`pipeline_lib.partition.optimal_split`, calling each layer as the classic Pipe does: a
tuple or list is spread into the next layer's positional arguments, so a model whose
layers take several arguments is balanced as it will run. Unlike the classic profiler,
it does not refuse a model whose parameters already hold gradients: it profiles copies,
so the gradients are left as they were.

The classic ``balance_by_size`` (CUDA only) is not here: `pipeline_lib.partition`'s
``balance_by_memory`` measures what a stage holds on any device.
"""
from __future__ import annotations

import time
from typing import Any

import torch
from torch import Tensor, nn

from pipeline_lib.partition import group_layers, layer_times, optimal_split

__all__ = ["balance_by_time"]


class _Spread(nn.Module):
    """Calls ``layer`` as the classic Pipe did: a tuple or list as positional arguments."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer = layer

    def forward(self, inputs: Any) -> Any:
        return self.layer(inputs) if isinstance(inputs, Tensor) else self.layer(*inputs)


def balance_by_time(partitions: int, module: nn.Sequential, sample: Any, *,
                    timeout: float = 1.0, device: torch.device | str | int = "cuda"
                    ) -> list[int]:
    """Layers per stage for ``partitions`` stages of about equal forward-plus-backward
    time, measured on ``device`` (by default the current GPU, as before) with ``sample``:
    a tensor, or a list or tuple of the first layer's arguments.

    As the classic profiler did, it measures every layer again and again until
    ``timeout`` seconds have passed (at least once), and compares the totals."""
    layers = group_layers(module, None)       # an nn.Sequential listing each layer once
    spread = nn.Sequential(*(_Spread(layer) for layer in layers))
    device = torch.device(device)
    totals = [0.0] * len(layers)
    started = time.perf_counter()
    while True:
        times = layer_times(spread, sample, repeats=1, device=device)
        totals = [total + t for total, t in zip(totals, times)]
        if time.perf_counter() - started >= timeout:
            return optimal_split(totals, partitions)
