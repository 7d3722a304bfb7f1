"""The caller's PyTorch modes, carried onto the threads that work for it.

PyTorch keeps several modes per thread: grad mode and inference mode, autocast (for each
device type: on or off and its dtype, and whether casts of weights are cached), the
saved-tensor hooks (`torch.autograd.graph.saved_tensors_hooks`, which
``torch.autograd.graph.save_on_cpu`` is), and the intra-op thread count. A new thread
starts with PyTorch's defaults, so a stage or replica thread would silently drop the
caller's ``with torch.autocast(...)`` (float32 where the plain model computes in
bfloat16: mixed precision silently off), its ``save_on_cpu`` (activations kept on the
GPU), or its ``torch.set_num_threads`` (OpenMP's one thread per core, on every thread).
`ThreadState.capture` reads them on the caller's thread and `ThreadState.applied`
re-enters them on a worker: the executors' threads then compute what the caller's
thread would have.

The backward a stage thread runs is covered too: the saved-tensor hooks' unpack runs
wherever autograd unpacks (it was packed with its pair), and autocast, which PyTorch
does not apply to backward ops, only matters to a checkpointed forward replayed there,
which must run under the forward's autocast, as ``torch.utils.checkpoint`` does.

PyTorch's own ``torch.nn.parallel.parallel_apply`` carries grad mode and whether autocast
is on, not its dtype nor the hooks; the autograd engine carries everything, in C++, for
its device threads, without a Python API. Other thread-local state (``torch.device`` as
a context manager, dispatch modes such as ``FlopCounterMode``) is not carried.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch.autograd.graph import saved_tensors_hooks


def _autocast_device_types() -> tuple[str, ...]:
    """The device types this PyTorch build has autocast for (asking about a device type
    it does not know raises)."""
    known = []
    for device_type in ("cpu", "cuda", "xpu", "mps", "hpu", "xla", "mtia", "maia", "ipu"):
        try:
            if torch.amp.is_autocast_available(device_type):
                known.append(device_type)
        except RuntimeError:
            pass
    return tuple(known)


AUTOCAST_DEVICE_TYPES = _autocast_device_types()

Hooks = tuple[Callable[[torch.Tensor], Any], Callable[[Any], torch.Tensor]]


def _active_saved_tensors_hooks() -> Hooks | None:
    """The (pack, unpack) pair ``saved_tensors_hooks`` pushed last on this thread, the only
    one that applies. PyTorch has no public way to read it: this is the private accessor
    that ``torch._functorch`` uses for the same purpose (True: whether or not
    torch.compile is tracing)."""
    return torch._C._autograd._top_saved_tensors_default_hooks(True)


@dataclass(frozen=True)
class ThreadState:
    """What `capture` read: grad and inference mode, the intra-op thread count, autocast
    (the device types it is on for, with their dtypes, and whether it caches), and the
    active saved-tensor hooks (None if none)."""

    grad_enabled: bool
    inference_mode: bool
    intra_op_threads: int
    autocast: tuple[tuple[str, torch.dtype], ...]
    autocast_cache: bool
    saved_tensors_hooks: Hooks | None

    @classmethod
    def capture(cls) -> ThreadState:
        """The calling thread's modes."""
        return cls(grad_enabled=torch.is_grad_enabled(),
                   inference_mode=torch.is_inference_mode_enabled(),
                   intra_op_threads=torch.get_num_threads(),
                   autocast=tuple((d, torch.get_autocast_dtype(d))
                                  for d in AUTOCAST_DEVICE_TYPES
                                  if torch.is_autocast_enabled(d)),
                   autocast_cache=torch.is_autocast_cache_enabled(),
                   saved_tensors_hooks=_active_saved_tensors_hooks())

    @contextlib.contextmanager
    def autocast_applied(self) -> Iterator[None]:
        """A block under the captured autocast only: for replaying a checkpointed forward
        in a backward, which autograd may run on any thread, under any other modes."""
        with contextlib.ExitStack() as stack:
            for device_type, dtype in self.autocast:
                stack.enter_context(torch.autocast(device_type, dtype,
                                                   cache_enabled=self.autocast_cache))
            yield

    @contextlib.contextmanager
    def applied(self) -> Iterator[None]:
        """A block under every captured mode. Meant for a thread of its own: the thread
        count, which has no block form, stays set after it."""
        torch.set_num_threads(self.intra_op_threads)
        with contextlib.ExitStack() as stack:
            if self.inference_mode:
                stack.enter_context(torch.inference_mode())
            stack.enter_context(torch.set_grad_enabled(self.grad_enabled))
            stack.enter_context(self.autocast_applied())
            if self.saved_tensors_hooks is not None:
                stack.enter_context(saved_tensors_hooks(*self.saved_tensors_hooks))
            yield
