"""Activation checkpointing policy and the "am I being recomputed?" flag.

A checkpointed stage keeps only its input during the forward and recomputes the forward
just before its backward: less memory for about one more forward of compute. The policy
says which micro-batches are checkpointed:

* ``always``: every micro-batch;
* ``except_last``: all but the last one, whose backward comes first in GPipe, so
  recomputing it would buy no memory (torchgpipe's default);
* ``never``: none.

The mechanism is `stage.StageRunner`'s, the only one: a checkpointed micro-batch's
forward runs under ``torch.no_grad()`` and its backward first replays it. Both
executors' steps and the classic ``pipe(x)`` run stages through it.

A replay recomputes; it must not count twice. Its normalisation layers' running
statistics (BatchNorm's running mean and variance and batch counter, and InstanceNorm's
when it tracks them) are put back as the first forward left them when it ends, so a
plain ``nn.BatchNorm2d`` sees each micro-batch once whatever the checkpoint mode. (A
training forward normalises with the micro-batch's own statistics, so the replay's
output does not depend on them.) Other layers with side effects read `is_recomputing`.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Iterator

from torch import nn
from torch.nn.modules.batchnorm import _NormBase

MODES = ("always", "except_last", "never")

_state = threading.local()


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"checkpoint must be one of {MODES}, got {mode!r}")
    return mode


def checkpointed(mode: str, microbatch: int, microbatches: int) -> bool:
    """Whether micro-batch ``microbatch`` of ``microbatches`` is checkpointed."""
    if mode == "always":
        return True
    if mode == "except_last":
        return microbatch < microbatches - 1
    return False


def is_recomputing() -> bool:
    """True while a checkpointed forward is being replayed for its backward.

    Layers with side effects read this: e.g. a running-statistics update that must happen
    once per micro-batch, not twice.
    """
    return getattr(_state, "recomputing", False)


def is_checkpointing() -> bool:
    """True during the first, gradient-free forward of a checkpointed micro-batch."""
    return getattr(_state, "checkpointing", False)


@contextlib.contextmanager
def _flag(name: str) -> Iterator[None]:
    previous = getattr(_state, name, False)
    setattr(_state, name, True)
    try:
        yield
    finally:
        setattr(_state, name, previous)


@contextlib.contextmanager
def recomputing(module: nn.Module) -> Iterator[None]:
    """The replay of ``module``'s forward: `is_recomputing` is True, and the running
    statistics of its normalisation layers are the same after as before."""
    stats = [buffer for layer in module.modules()
             if isinstance(layer, _NormBase) and layer.track_running_stats
             for buffer in (layer.running_mean, layer.running_var, layer.num_batches_tracked)
             if buffer is not None]
    kept = [buffer.clone() for buffer in stats]
    try:
        with _flag("recomputing"):
            yield
    finally:
        # through .data, which autograd does not version: batch_norm's backward keeps
        # the running statistics among its inputs (unused in training), and a tracked
        # write would fail it as "modified by an inplace operation"
        for buffer, value in zip(stats, kept):
            buffer.data.copy_(value)


def checkpointing() -> contextlib.AbstractContextManager:
    return _flag("checkpointing")
