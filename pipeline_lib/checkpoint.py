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
"""
from __future__ import annotations

import contextlib
import threading
from typing import Iterator

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


def recomputing() -> contextlib.AbstractContextManager:
    return _flag("recomputing")


def checkpointing() -> contextlib.AbstractContextManager:
    return _flag("checkpointing")
