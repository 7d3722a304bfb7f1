"""Measure memory on any device, CPU included, where allocator statistics do not help.

`SavedActivations`: the activation memory each stage holds, over time, during a real step.

Activation memory is what autograd saves in the forward for the backward. Counting it with
`torch.autograd.graph.saved_tensors_hooks` works the same on CPU and GPU, unlike allocator
statistics, and tells stages apart even when they share a device (CPU stage threads).

Saved-tensor hooks are per thread and a stage runs on its own thread, so they are
installed around each call of the stage module (forward hooks), which also catches the
forward that a checkpointed stage replays before its backward. What they do not see:
the stage *inputs* a checkpointed stage keeps for that replay (one tensor per micro-batch),
and whatever the loss function saves on the last stage, which runs outside its module.
`pipeline_lib.partition.layer_memory` counts each layer's activations with it too.

`CountedLoss`: a loss function that counts, with the same hooks, what *it* saves for its
backward (a language model's log-softmax: one float per logit, often the largest
activation of all), which `SavedActivations` cannot see.

`PeakTensorMemory`: the peak of tensor memory a block of code allocates. GPUs answer this
with ``torch.cuda.max_memory_allocated``; the CPU allocator keeps no such statistic. So
`PeakTensorMemory` watches every operation PyTorch runs inside the block (a
``TorchDispatchMode`` sees them all, forward and backward): each output that does not share
its storage with an input (an in-place op or a view allocates nothing) is a new allocation
and counts its storage's bytes until that storage is freed. The peak of that running total
is the answer: activations, outputs, gradients and temporaries alike.

Not counted: tensors that existed before the block (weights, the batch), and memory
outside PyTorch's tensors. The number is exact bytes of tensor storage, not the
allocator's rounded blocks, so it is comparable across machines and repeatable.
"""
from __future__ import annotations

import threading
import time
import weakref
from typing import Any, Callable, Sequence

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

_Key = tuple[int, int]   # (data pointer, bytes) of a saved tensor


class _Held:
    """What autograd stores instead of a saved tensor. The graph drops it when the
    backward frees the saved tensors, and that is when the bytes stop counting."""

    def __init__(self, tensor: Tensor, release: Callable[[], None]):
        self.tensor = tensor
        self._release = release

    def __del__(self) -> None:
        self._release()


class SavedActivations:
    """Bytes of saved activations per stage: now, over time, and at the peak.

    ``with SavedActivations(pipe.partitions) as saved: pipe.step(...)``; then
    ``saved.peak[s]`` is stage s's largest total and ``saved.history[s]`` the
    ``(seconds since entering, bytes)`` after every change. A tensor saved by several
    layers (a ReLU output that the next Linear saves too) counts once; parameters and
    buffers are model state, not activations, and do not count.
    """

    def __init__(self, stages: Sequence[nn.Module]):
        self.stages = list(stages)
        self.held = [0] * len(self.stages)
        self.peak = [0] * len(self.stages)
        self.history: list[list[tuple[float, int]]] = [[] for _ in self.stages]
        self._counts: list[dict[_Key, int]] = [{} for _ in self.stages]
        self._lock = threading.RLock()   # a release can run inside a pack on any thread
        self._active = threading.local()
        self._handles: list[Any] = []
        self._t0: float | None = None

    def __enter__(self) -> "SavedActivations":
        if self._t0 is not None:
            raise RuntimeError("a SavedActivations measures once (its history starts when "
                               "it is entered); create a new one for each measurement")
        self._t0 = time.perf_counter()
        for s, module in enumerate(self.stages):
            model_state = {t.untyped_storage().data_ptr()
                           for t in [*module.parameters(), *module.buffers()]}
            self._handles.append(
                module.register_forward_pre_hook(self._enter_hooks(s, model_state)))
            self._handles.append(
                module.register_forward_hook(self._exit_hooks, always_call=True))
        return self

    def __exit__(self, *exc_info: Any) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _change(self, stage: int, key: _Key, nbytes: int, delta: int) -> None:
        """Count a tensor when its first saver appears and uncount it when its last goes."""
        with self._lock:
            counts = self._counts[stage]
            before = counts.pop(key, 0)
            now = before + delta
            if now:
                counts[key] = now
            if before == 0 or now == 0:
                self.held[stage] += nbytes * delta
                self.peak[stage] = max(self.peak[stage], self.held[stage])
                self.history[stage].append((time.perf_counter() - self._t0,
                                            self.held[stage]))

    def _enter_hooks(self, stage: int, model_state: set[int]) -> Callable[..., None]:
        """A forward pre-hook that starts counting what ``stage`` saves, on this thread."""
        def pack(tensor: Tensor) -> Any:
            if tensor.untyped_storage().data_ptr() in model_state:
                return tensor
            key, nbytes = (tensor.data_ptr(), tensor.nbytes), tensor.nbytes
            self._change(stage, key, nbytes, +1)
            return _Held(tensor, lambda: self._change(stage, key, nbytes, -1))

        def unpack(packed: Any) -> Tensor:
            return packed.tensor if isinstance(packed, _Held) else packed

        def pre_hook(module: nn.Module, args: Any) -> None:
            hooks = torch.autograd.graph.saved_tensors_hooks(pack, unpack)
            hooks.__enter__()
            self._stack().append(hooks)
        return pre_hook

    def _exit_hooks(self, module: nn.Module, args: Any, output: Any) -> None:
        self._stack().pop().__exit__(None, None, None)

    def _stack(self) -> list:
        """The hooks this thread has entered: stage threads measure independently."""
        if not hasattr(self._active, "stack"):
            self._active.stack = []
        return self._active.stack


class CountedLoss:
    """``loss_fn`` that counts the bytes it saves for its backward while autograd holds them.

    ``counted = CountedLoss(lm_loss)``; pass ``counted`` where the loss goes (``pipe.step(x,
    y, counted)``); then ``counted.peak`` is the most bytes its saved tensors held at once,
    over every call, and ``counted.held`` what is still held (0 once every backward ran).
    A tensor saved twice (cross-entropy saves its log-probabilities in log-softmax and again
    in the loss that reads them) exists once, so it counts once. The hooks are installed
    around each call, on the calling thread: the last stage's thread, in a pipeline.
    """

    def __init__(self, loss_fn: Callable[..., Tensor]):
        self.loss_fn = loss_fn
        self.held = 0
        self.peak = 0
        self._counts: dict[_Key, int] = {}
        self._lock = threading.Lock()

    def _change(self, key: _Key, delta: int) -> None:
        with self._lock:
            before = self._counts.pop(key, 0)
            now = before + delta
            if now:
                self._counts[key] = now
            if before == 0 or now == 0:
                self.held += key[1] * delta
                self.peak = max(self.peak, self.held)

    def _pack(self, tensor: Tensor) -> _Held:
        key = (tensor.data_ptr(), tensor.nbytes)
        self._change(key, +1)
        return _Held(tensor, lambda: self._change(key, -1))

    def __call__(self, *args: Any, **kwargs: Any) -> Tensor:
        with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda held: held.tensor):
            return self.loss_fn(*args, **kwargs)


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
