"""Count, during a block, the calls that make the host wait for a CUDA device.

On a GPU, kernels are only queued: the host runs ahead and the device works through its
queue. A call that needs a result on the host, or a copy from memory the driver must
stage first, empties that queue and stalls the pipeline it was feeding:

* value reads: ``Tensor.item``, ``.tolist``, ``.numpy``, ``float(t)``, ``int(t)``,
  ``bool(t)`` (``if t:``), ``t.__index__`` (``range(t)``);
* copies to the host (``.cpu()``, ``.to("cpu")``, ``copy_`` into a CPU tensor), and
  copies to a GPU that block: from pageable memory, or without ``non_blocking=True``;
  ``torch.tensor(data, device=...)`` (a pageable copy, always);
* waits: ``torch.distributed``'s ``Work.wait`` (every blocking send, receive and
  collective goes through it), ``torch.cuda.synchronize``, ``Stream.synchronize``,
  ``Event.synchronize``.

On the CPU none of these stalls anything, so time cannot show them: `HostSyncs` records
the calls instead, each with the line of the caller (outside torch) that made it. CPU
tensors stand for device tensors by default (``cpu_stands_for_device``): a value read of
any tensor counts, and so does ``torch.tensor(data, device=d)`` for any ``d``; copies
count only where they really change device (a fake CUDA in a test).

A test proves "nothing per message or per micro-batch" by counting one steady-state
step (after a first one of the same shapes) at two micro-batch counts and requiring the
same count, naming the sites that remain (`HostSyncs.by_site`)::

    with HostSyncs() as syncs:
        pipe.step(x, y, loss_fn)
    assert syncs.by_site() == {...}

Every thread's calls count while the block runs (stage threads included); blocks do not
nest.
"""
from __future__ import annotations

import collections
import os
import sys
import threading
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

_TORCH = os.path.dirname(torch.__file__) + os.sep
_HERE = os.path.abspath(__file__)
_ROOT = os.path.dirname(os.path.dirname(_HERE)) + os.sep
_active = threading.Lock()   # held while a block counts: blocks do not nest
_INHERITED = object()        # an attribute the patched class did not define itself

VALUE_READS = ("item", "tolist", "numpy", "__float__", "__int__", "__bool__", "__index__")


@dataclass(frozen=True)
class Sync:
    """One call that waits for a device: what it was and the line that made it."""

    kind: str    # "Tensor.item", "copy to the host", "Work.wait", ...
    where: str   # "pipeline_lib/loss.py:107 in micro_loss"

    @property
    def site(self) -> str:
        """``where`` without the line number: "pipeline_lib/loss.py in micro_loss"."""
        path, _, rest = self.where.partition(":")
        return f"{path} {rest.partition(' ')[2]}"


def _caller() -> str:
    """The innermost frame outside torch and this module: the line that asked."""
    frame = sys._getframe(2)
    while frame is not None:
        name = os.path.abspath(frame.f_code.co_filename)
        if not name.startswith(_TORCH) and name != _HERE:
            return f"{name.removeprefix(_ROOT)}:{frame.f_lineno} in {frame.f_code.co_name}"
        frame = frame.f_back
    return "?"


def _is_device(device: torch.device) -> bool:
    return device.type not in ("cpu", "meta")


class HostSyncs:
    """The calls that would make the host wait for a device, made while the block runs
    (see the module docstring). ``cpu_stands_for_device``: count value reads of CPU
    tensors, and ``torch.tensor(..., device=...)`` on any device, as a CPU test must."""

    def __init__(self, cpu_stands_for_device: bool = True):
        self.cpu = cpu_stands_for_device
        self.calls: list[Sync] = []
        self._undo: list[tuple[Any, str, Any]] = []

    def __len__(self) -> int:
        return len(self.calls)

    def by_site(self) -> dict[str, int]:
        """How many calls each site made (file and function, without line numbers)."""
        return dict(collections.Counter(call.site for call in self.calls))

    def __str__(self) -> str:
        sites = collections.Counter(f"{c.kind} at {c.where}" for c in self.calls)
        return "\n".join(f"{n:4} x {site}" for site, n in sites.most_common()) or "none"

    def _add(self, kind: str) -> None:
        self.calls.append(Sync(kind, _caller()))

    def _patch(self, owner: Any, name: str, make: Callable[[Any], Any]) -> None:
        """Replace ``owner.name`` (perhaps inherited) until the block ends."""
        self._undo.append((owner, name, owner.__dict__.get(name, _INHERITED)))
        setattr(owner, name, make(getattr(owner, name)))

    # -- what counts -------------------------------------------------------------------

    def _counts_read(self, tensor: torch.Tensor) -> bool:
        return self.cpu or _is_device(tensor.device)

    def _read(self, name: str) -> Callable[[Any], Any]:
        def make(original: Any) -> Any:
            def read(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
                if self._counts_read(tensor):
                    self._add(f"Tensor.{name}")
                return original(tensor, *args, **kwargs)
            return read
        return make

    def _move(self, source: torch.Tensor, target: torch.device | None,
              non_blocking: bool) -> None:
        """Count a copy of ``source`` to ``target`` that waits for a device."""
        if target is None or target == source.device:
            return
        if _is_device(source.device) and target.type == "cpu":
            self._add("copy to the host")
        elif source.device.type == "cpu" and _is_device(target) and not (
                non_blocking and source.is_pinned()):
            self._add("blocking copy to a device" if source.is_pinned()
                      else "copy from pageable memory")

    def _to(self, original: Any) -> Any:
        def to(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            device, _, non_blocking, _ = torch._C._nn._parse_to(*args, **kwargs)
            self._move(tensor, None if device is None else torch.device(device), non_blocking)
            return original(tensor, *args, **kwargs)
        return to

    def _cpu(self, original: Any) -> Any:
        def cpu(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            self._move(tensor, torch.device("cpu"), False)
            return original(tensor, *args, **kwargs)
        return cpu

    def _copy(self, original: Any) -> Any:
        def copy_(tensor: torch.Tensor, source: torch.Tensor, non_blocking: bool = False) -> Any:
            self._move(source, tensor.device, non_blocking)
            return original(tensor, source, non_blocking)
        return copy_

    def _from_data(self, original: Any) -> Any:
        def tensor(data: Any, *args: Any, device: Any = None, **kwargs: Any) -> Any:
            if device is not None and (self.cpu or _is_device(torch.device(device))):
                self._add(f"torch.{original.__name__}(data, device=...)")
            return original(data, *args, device=device, **kwargs)
        return tensor

    def _wait(self, kind: str) -> Callable[[Any], Any]:
        def make(original: Any) -> Any:
            def wait(*args: Any, **kwargs: Any) -> Any:
                self._add(kind)
                return original(*args, **kwargs)
            return wait
        return make

    # -- the block ---------------------------------------------------------------------

    def __enter__(self) -> HostSyncs:
        if not _active.acquire(blocking=False):
            raise RuntimeError("HostSyncs blocks do not nest")
        for name in VALUE_READS:
            self._patch(torch.Tensor, name, self._read(name))
        self._patch(torch.Tensor, "to", self._to)
        self._patch(torch.Tensor, "cpu", self._cpu)
        self._patch(torch.Tensor, "copy_", self._copy)
        self._patch(torch, "tensor", self._from_data)
        self._patch(torch, "as_tensor", self._from_data)
        if dist.is_available():
            self._patch(dist.Work, "wait", self._wait("Work.wait"))
        self._patch(torch.cuda, "synchronize", self._wait("torch.cuda.synchronize"))
        self._patch(torch.cuda.Stream, "synchronize", self._wait("Stream.synchronize"))
        self._patch(torch.cuda.Event, "synchronize", self._wait("Event.synchronize"))
        return self

    def __exit__(self, *exc: Any) -> None:
        while self._undo:
            owner, name, original = self._undo.pop()
            if original is _INHERITED:
                delattr(owner, name)
            else:
                setattr(owner, name, original)
        _active.release()
