"""The classic `Pipe`: `pipeline_lib.Pipe` with ``torch.distributed.pipeline.sync``'s
calling conventions.

What the classic API did differently, and how each point maps onto `pipeline_lib.Pipe`:

* Stages come from the model's top-level children as the classic `Pipe` cut them (see
  `_stages`): consecutive children on one GPU share a stage, a child on the CPU is a stage
  of its own, a plain ``nn.Sequential`` child is unpacked into its layers and a
  `WithDevice` child into its module, which moves to the device it names.
* ``pipe(*inputs)`` feeds the positional inputs to the first layer, split by the classic
  rules (`sync.microbatch`: ``torch.chunk`` sizes, top-level tensors only), and a layer's
  tuple output becomes the next layer's positional arguments (a list output too, between
  stages). Each stage is a `_Stage`; the executor carries tuples as it carries any batch.
* The output is wrapped in an RRef-like `LocalRRef` (``.local_value()``, ``.to_here()``).
* A non-tensor in the last stage's output becomes the list of its values, one per
  micro-batch; a stage output with no tensor at all is refused.
* ``chunks`` and ``checkpoint`` are coerced with ``int()`` and ``str()``; an empty
  ``nn.Sequential`` is the identity.
* Inside `DistributedDataParallel` the micro-batches run in one autograd graph (see
  `Pipe._forward_in_one_graph`).
* ``.cuda()``, ``.cpu()`` and ``.to(device)`` raise `TypeError`, even where they would
  not move anything; ``len``, indexing and iteration go over the layers, not the stages.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Generic, Iterator, TypeVar

import torch
import torch.utils._pytree as pytree
from torch import Tensor, nn

from pipeline_lib import batchnorm
from pipeline_lib.checkpoint import check_mode, is_recomputing
from pipeline_lib.devices import WithDevice, indexed, transfer
from pipeline_lib.microbatch import gather
from pipeline_lib.partition import group_layers
from pipeline_lib.sync import microbatch
from pipeline_lib.sync.batchnorm import DeferredBatchNorm
from pipeline_lib.sync.skip import verify_skippables
from pipeline_lib.threaded import pipe as threaded

T = TypeVar("T")


@dataclass(eq=False, repr=False)
class LocalRRef(Generic[T]):
    """What the classic ``Pipe.forward`` returned: a reference to the output.

    The classic API returned a ``torch.distributed.rpc.RRef`` so that the output could
    one day live on another host; it was always local, as here, so
    ``local_value()`` and ``to_here()`` both just return it. No RPC is needed.

    `DistributedDataParallel` looks into the output of the module it wraps for the
    tensors the backward starts from (``find_unused_parameters=True`` walks the graph
    from them; ``static_graph=True`` hooks its all-reduce onto them), and it unwrapped
    an RRef for that. A dataclass registered with PyTorch's pytree is what it looks
    into here: both flags then work as on the plain model.
    """

    _value: T

    def local_value(self) -> T:
        return self._value

    def to_here(self, timeout: float | None = None) -> T:
        return self._value

    def is_owner(self) -> bool:
        return True

    def backward(self, dist_autograd_ctx_id: int = -1, retain_graph: bool = False) -> None:
        """Backward from the referenced value, a scalar tensor, as ``RRef.backward`` did:
        with autograd, or with distributed autograd in the context ``dist_autograd_ctx_id``
        (which needs ``torch.distributed.rpc`` initialised, as it did there)."""
        if dist_autograd_ctx_id == -1:
            torch.autograd.backward(self._value, retain_graph=retain_graph)
        else:
            import torch.distributed.autograd as dist_autograd
            dist_autograd.backward(dist_autograd_ctx_id, [self._value], retain_graph)

    def __repr__(self) -> str:
        return f"LocalRRef({type(self._value).__name__})"


pytree.register_dataclass(LocalRRef, serialized_type_name="pipeline_lib.sync.LocalRRef")


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
    """A stage of the classic API: a layer given a tuple gets its items as positional
    arguments, anything else as its one argument. The first layer gets the micro-batch
    (the inputs' tuple, or one tensor); a list output is one argument, as it was in the
    classic stage (only between stages did a list spread).

    ``record``, when a list, receives the non-tensor values of each micro-batch's output
    (tensors as None), which then leave the stage as None: `Pipe` sets it on the last
    stage, whose thread runs the forwards in micro-batch order (a checkpoint's
    recomputation is not recorded again).
    """

    record: list[tuple[Any, ...]] | None = None

    def forward(self, inputs: Any) -> Any:
        for layer in self:
            inputs = layer(*inputs) if isinstance(inputs, tuple) else layer(inputs)
        output = _stage_output(inputs)
        if self.record is not None and isinstance(output, tuple):
            # the non-tensors leave by the record; the executor joins only the tensors
            if not is_recomputing():
                self.record.append(tuple(None if isinstance(v, Tensor) else v
                                         for v in output))
            output = tuple(v if isinstance(v, Tensor) else None for v in output)
        return output


def _layer_device(layer: nn.Module) -> torch.device:
    """Where the classic Pipe ran a top-level child: where all its parameters are (the
    CPU if it has none)."""
    devices = {p.device for p in layer.parameters()}
    if len(devices) > 1:
        raise ValueError(f"{type(layer).__name__} has parameters on several devices "
                         f"{sorted(map(str, devices))}, but each top-level child of the "
                         f"nn.Sequential must have all its parameters on a single device; "
                         f"use .to() to place it on one, or split it into several children")
    return devices.pop() if devices else torch.device("cpu")


def _stages(layers: list[nn.Module]) -> tuple[list[_Stage], list[torch.device]]:
    """The classic Pipe's stages and their devices: consecutive children on one GPU form a
    stage; a child on the CPU is a stage of its own. A `WithDevice` child is replaced by
    its module, moved to the device it names; a plain ``nn.Sequential`` child gives its
    layers (a subclass keeps its own forward, so it stays one layer)."""
    groups: list[list[nn.Module]] = []
    devices: list[torch.device] = []
    for layer in layers:
        if isinstance(layer, WithDevice):
            device = indexed(layer.device)
            layer = layer.module.to(device)
        else:
            device = indexed(_layer_device(layer))
        if not groups or device != devices[-1] or device.type == "cpu":
            groups.append([])
            devices.append(device)
        groups[-1].extend(layer if type(layer) is nn.Sequential else [layer])
    return [_Stage(*group) for group in groups], devices


class Pipe(threaded.Pipe):
    """``torch.distributed.pipeline.sync.Pipe``: wrap an ``nn.Sequential`` whose layers
    are already on their devices; consecutive layers on one GPU form a stage::

        model = Pipe(nn.Sequential(*module_list), chunks=8)
        output = model(data).local_value()
        loss = criterion(output, target)
        loss.backward()

    ``chunks``, ``checkpoint`` and ``deferred_batch_norm`` mean what they meant there
    (and in `pipeline_lib.Pipe`, which runs it: ``pipe.step`` works too, with that
    class's rules for its inputs). ``pipe(*inputs)`` splits them as `sync.microbatch`
    says. Tensor inputs must be on the first stage's device.
    `torch.distributed.rpc` need not be initialised (the classic API required it) but may
    be.
    """

    def __init__(self, module: nn.Sequential, chunks: int = 1,
                 checkpoint: str = "except_last", deferred_batch_norm: bool = False):
        chunks, checkpoint = int(chunks), str(checkpoint)   # as the classic Pipe did
        if chunks <= 0:
            raise ValueError(f"chunks must be a positive integer, got {chunks}")
        check_mode(checkpoint)
        if not isinstance(module, nn.Sequential):
            raise TypeError(f"Pipe needs an nn.Sequential, got {type(module).__name__}; "
                            f"list the layers in order: nn.Sequential(layer0, layer1, ...)")
        verify_skippables(module)
        if deferred_batch_norm:
            module = DeferredBatchNorm.convert_deferred_batch_norm(module, chunks)
        if len(module) == 0:
            # Nothing to run: the classic Pipe returned its input. No stage, no thread,
            # so none of the executor's set-up applies.
            nn.Module.__init__(self)
            self.chunks, self.checkpoint, self.timeline = chunks, checkpoint, None
            self.partitions, self.devices, self.skip_routes = nn.ModuleList(), [], []
            return
        stages, devices = _stages(group_layers(module, None))
        super().__init__(nn.Sequential(*stages), chunks, checkpoint, devices=devices)

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
        the pipeline; returns a `LocalRRef` to the output."""
        microbatch.check(self.devices[0] if self.devices else torch.device("cpu"), inputs)
        if not self.partitions:
            return LocalRRef(inputs[0] if len(inputs) == 1 else inputs)
        batches = microbatch.scatter(inputs, self.chunks)
        last = self.partitions[-1]
        last.record = []
        try:
            with self._microbatches(len(batches)):
                if threaded.run_by_data_parallel(self):
                    output = self._forward_in_one_graph(batches)
                else:
                    output = super().forward(batches)
            if isinstance(output, tuple):   # non-tensors: the list of every micro-batch's
                output = tuple(value if isinstance(value, Tensor)
                               else [values[k] for values in last.record]
                               for k, value in enumerate(output))
        finally:
            last.record = None
        return LocalRRef(output)

    def _forward_in_one_graph(self, batches: list[Any]) -> Any:
        """The micro-batches one after another through the stages, in one autograd graph.

        For `DistributedDataParallel`, which wrapped each process's Pipe in the classic
        DDP tutorial: it all-reduces a parameter's gradient as soon as autograd has
        accumulated it, expecting that to happen once per backward. The executor's
        backward accumulates it once per micro-batch (each stage's backward is its own),
        so DDP would average partial sums. The classic Pipe built one graph for all
        micro-batches, as this does; checkpointing broke that there too, which is why its
        documentation allowed DDP only with ``checkpoint="never"``."""
        if self.checkpoint != "never" and torch.is_grad_enabled() and self.training:
            raise ValueError(f"a Pipe inside DistributedDataParallel must be built with "
                             f"checkpoint='never' (it has {self.checkpoint!r}): a "
                             f"checkpointed stage accumulates each gradient once per "
                             f"micro-batch, and DDP would all-reduce the first partial "
                             f"sum; the classic API had the same rule")
        outputs = []
        for x in batches:
            for stage, device in zip(self.partitions, self.devices):
                x = stage(transfer(x, device))
            outputs.append(x)
        return gather(outputs)

    @contextlib.contextmanager
    def _microbatches(self, count: int) -> Iterator[None]:
        """Tell DeferredBatchNorm layers that this mini-batch has ``count`` micro-batches
        (``torch.chunk`` may make fewer than ``chunks``), so they commit their statistics
        once, after the last."""
        layers = [m for m in self.modules() if isinstance(m, batchnorm.DeferredBatchNorm)]
        saved = [layer.chunks for layer in layers]
        for layer in layers:
            layer.chunks = count
        try:
            yield
        finally:
            for layer, value in zip(layers, saved):
                layer.chunks = value


def _moving_denied() -> TypeError:
    return TypeError("a Pipe cannot be moved: it keeps each stage on the device it was "
                     "built on. Move the layers before wrapping them (or wrap a layer in "
                     "WithDevice); only a dtype conversion, pipe.to(torch.float64), works")
