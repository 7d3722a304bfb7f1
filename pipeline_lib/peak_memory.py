"""The peak of tensor memory a block of code allocates, on any device, CPU included.

GPUs answer this with ``torch.cuda.max_memory_allocated``; the CPU allocator keeps no such
statistic. So `PeakTensorMemory` watches every operation PyTorch runs inside the block
(a ``TorchDispatchMode`` sees them all, forward and backward): each output that does not
share its storage with an input (an in-place op or a view allocates nothing) is a new
allocation and counts its storage's bytes until that storage is freed. The peak of that
running total is the answer: activations, outputs, gradients and temporaries alike.

Not counted: tensors that existed before the block (weights, the batch), and memory
outside PyTorch's tensors. The number is exact bytes of tensor storage, not the
allocator's rounded blocks, so it is comparable across machines and repeatable.
"""
from __future__ import annotations

import threading
import weakref
from typing import Any

from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary


class PeakTensorMemory(TorchDispatchMode):
    """``with PeakTensorMemory() as memory: ...``; then ``memory.peak`` is the most bytes
    of tensors allocated inside the block that were alive at the same time, and
    ``memory.current`` what is still alive (the block's results)."""

    def __init__(self) -> None:
        super().__init__()
        self.current = 0
        self.peak = 0
        self._counted: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._lock = threading.Lock()   # frees can arrive from autograd's threads

    def _freed(self, nbytes: int) -> None:
        with self._lock:
            self.current -= nbytes

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr()
                  for t in tree_leaves((args, kwargs)) if isinstance(t, Tensor)}
        for t in tree_leaves(out):
            if not isinstance(t, Tensor):
                continue
            storage = t.untyped_storage()
            if storage.data_ptr() in inputs or storage in self._counted:
                continue
            nbytes = storage.nbytes()
            self._counted[storage] = True
            weakref.finalize(storage, self._freed, nbytes)
            with self._lock:
                self.current += nbytes
                self.peak = max(self.peak, self.current)
        return out
