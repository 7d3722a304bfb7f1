"""The classic `Pipe`: `pipeline_lib.Pipe` with ``torch.distributed.pipeline.sync``'s
calling conventions.

What the classic API did differently, and how each point maps onto `pipeline_lib.Pipe`:

* ``pipe(*inputs)`` feeds the positional inputs to the first layer, and a layer's tuple
  (or list) output becomes the next layer's positional arguments. Each stage is a
  `_Stage`, an ``nn.Sequential`` that spreads tuples; the executor carries them as it
  carries any tuple batch.
* The output is wrapped in an RRef-like `LocalRRef` (``.local_value()``, ``.to_here()``).
* A batch smaller than ``chunks`` runs as that many micro-batches of one row.
* A non-tensor in the last stage's output becomes the list of its values, one per
  micro-batch; a stage output with no tensor at all is refused.
* ``.cuda()``, ``.cpu()`` and ``.to(device)`` raise `TypeError`, even where they would
  not move anything; ``len``, indexing and iteration go over the layers, not the stages.
"""
from __future__ import annotations

import contextlib
from typing import Any, Generic, Iterator, TypeVar

import torch
from torch import Tensor, nn

from pipeline_lib.batchnorm import DeferredBatchNorm
from pipeline_lib.checkpoint import is_recomputing
from pipeline_lib.partition import group_layers
from pipeline_lib.threaded import pipe as threaded

T = TypeVar("T")


class LocalRRef(Generic[T]):
    """What the classic ``Pipe.forward`` returned: a reference to the output.

    The classic API returned a ``torch.distributed.rpc.RRef`` so that the output could
    one day live on another host; it was always local, as here, so
    ``local_value()`` and ``to_here()`` both just return it. No RPC is needed.
    """

    __slots__ = ("_value",)

    def __init__(self, value: T):
        self._value = value

    def local_value(self) -> T:
        return self._value

    def to_here(self, timeout: float | None = None) -> T:
        return self._value

    def is_owner(self) -> bool:
        return True

    def __repr__(self) -> str:
        return f"LocalRRef({type(self._value).__name__})"


def _stage_output(value: Any) -> Any:
    """A stage's output as the executor carries it: a tensor or a tuple holding one."""
    if isinstance(value, list):
        value = tuple(value)
    if isinstance(value, Tensor) or (isinstance(value, tuple)
                                     and any(isinstance(v, Tensor) for v in value)):
        return value
    raise TypeError(f"a stage returned {type(value).__name__} {value!r:.60}, with no tensor; "
                    f"between stages the classic Pipe carries a tensor or a tuple holding "
                    f"at least one tensor")


class _Stage(nn.Sequential):
    """A stage of the classic API: each layer gets the previous one's tuple output as its
    positional arguments (the first one, the micro-batch's inputs).

    ``record``, when a list, receives the non-tensor values of each micro-batch's output
    (tensors as None), which then leave the stage as None: `Pipe` sets it on the last
    stage, whose thread runs the forwards in micro-batch order (a checkpoint's
    recomputation is not recorded again).
    """

    record: list[tuple[Any, ...]] | None = None

    def forward(self, inputs: Any) -> Any:
        for layer in self:
            inputs = layer(*inputs) if isinstance(inputs, (tuple, list)) else layer(inputs)
        output = _stage_output(inputs)
        if self.record is not None and isinstance(output, tuple):
            # the non-tensors leave by the record; the executor joins only the tensors
            if not is_recomputing():
                self.record.append(tuple(None if isinstance(v, Tensor) else v
                                         for v in output))
            output = tuple(v if isinstance(v, Tensor) else None for v in output)
        return output


class Pipe(threaded.Pipe):
    """``torch.distributed.pipeline.sync.Pipe``: wrap an ``nn.Sequential`` whose layers
    are already on their devices; each top-level child is one stage (a child that is an
    ``nn.Sequential`` groups its layers into one stage)::

        model = Pipe(nn.Sequential(*module_list), chunks=8)
        output = model(data).local_value()
        loss = criterion(output, target)
        loss.backward()

    ``chunks``, ``checkpoint`` and ``deferred_batch_norm`` mean what they meant there
    (and in `pipeline_lib.Pipe`, which runs it: ``pipe.step`` works too). Inputs are split
    along dim 0; non-tensors and `NoChunk` tensors go whole to every micro-batch. Tensor
    inputs must be on the first stage's device. `torch.distributed.rpc` need not be
    initialised (the classic API required it) but may be.
    """

    def __init__(self, module: nn.Sequential, chunks: int = 1,
                 checkpoint: str = "except_last", deferred_batch_norm: bool = False):
        # group_layers checks the model (an nn.Sequential listing each layer once). A
        # plain nn.Sequential child is one stage of its layers; a subclass keeps its own
        # forward, so it is one layer.
        stages = [_Stage(*child) if type(child) is nn.Sequential else _Stage(child)
                  for child in group_layers(module, None)]
        super().__init__(nn.Sequential(*stages), chunks, checkpoint,
                         deferred_batch_norm=deferred_batch_norm)

    # -- an nn.Sequential of layers, as the classic Pipe was ------------------------------

    def __len__(self) -> int:
        return sum(len(stage) for stage in self.partitions)

    def __iter__(self) -> Iterator[nn.Module]:
        for stage in self.partitions:
            yield from stage

    def __getitem__(self, index: int) -> nn.Module:
        return list(self)[index]

    # -- stages stay where they are -------------------------------------------------------

    def cuda(self, device: Any = None) -> Pipe:
        raise _moving_denied()

    def cpu(self) -> Pipe:
        raise _moving_denied()

    def to(self, *args: Any, **kwargs: Any) -> Pipe:
        """Only a dtype conversion, as in the classic API: ``pipe.to(torch.float64)``."""
        if "device" in kwargs or "tensor" in kwargs or (
                args and isinstance(args[0], (torch.device, int, str, Tensor))):
            raise _moving_denied()
        return super().to(*args, **kwargs)

    # -- forward --------------------------------------------------------------------------

    def forward(self, *inputs: Any) -> LocalRRef:
        """Run the mini-batch ``inputs`` (the first layer's positional arguments) through
        the pipeline; returns a `LocalRRef` to the output. A batch of fewer rows than
        ``chunks`` runs as one micro-batch per row."""
        for value in inputs:
            if isinstance(value, Tensor) and value.device != self.devices[0]:
                raise ValueError(f"every input tensor must be on the first stage's device "
                                 f"{self.devices[0]}, got one on {value.device}; move it "
                                 f"there (the classic Pipe required this too)")
        batch = inputs[0] if len(inputs) == 1 and isinstance(inputs[0], Tensor) else inputs
        rows = min((v.size(0) for v in inputs if isinstance(v, Tensor) and v.dim() > 0),
                   default=self.chunks)
        last = self.partitions[-1]
        last.record = []
        try:
            with self._chunks(min(rows, self.chunks)):
                output = super().forward(batch)
            if isinstance(output, tuple):   # non-tensors: the list of every micro-batch's
                output = tuple(value if isinstance(value, Tensor)
                               else [values[k] for values in last.record]
                               for k, value in enumerate(output))
        finally:
            last.record = None
        return LocalRRef(output)

    @contextlib.contextmanager
    def _chunks(self, chunks: int) -> Iterator[None]:
        """Run with ``chunks`` micro-batches, telling DeferredBatchNorm layers too (they
        commit their statistics after that many)."""
        users = [self, *(m for m in self.modules() if isinstance(m, DeferredBatchNorm))]
        saved = [user.chunks for user in users]
        for user in users:
            user.chunks = chunks
        try:
            yield
        finally:
            for user, value in zip(users, saved):
                user.chunks = value


def _moving_denied() -> TypeError:
    return TypeError("a Pipe cannot be moved: it keeps each stage on the device it was "
                     "built on. Move the layers before wrapping them (or wrap a layer in "
                     "WithDevice); only a dtype conversion, pipe.to(torch.float64), works")
