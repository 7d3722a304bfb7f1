"""``torch.distributed.pipeline.sync``, the classic pipeline API, on `pipeline_lib`.

PyTorch 2.4 removed it; code written for it runs with its imports changed::

    from torch.distributed.pipeline.sync import Pipe      # before
    from pipeline_lib.sync import Pipe                    # here

    model = Pipe(torch.nn.Sequential(*module_list), chunks=8)
    output = model(data).local_value()

`Pipe` maps the classic calling conventions onto `pipeline_lib.Pipe` (see `sync.pipe`),
splitting inputs by the classic rules (`sync.microbatch`). The classic submodules are
here under the same names: ``pipeline_lib.sync.skip`` (skip connections),
``pipeline_lib.sync.batchnorm`` (`DeferredBatchNorm`) and ``pipeline_lib.sync.balance``
(was ``._balance``: `balance_by_time`). `torch.distributed.rpc` is not needed. New code
can use `pipeline_lib.Pipe` directly, which also runs schedules (``pipe.step``).
"""
from pipeline_lib.checkpoint import is_checkpointing, is_recomputing
from pipeline_lib.devices import WithDevice
from pipeline_lib.microbatch import NoChunk
from pipeline_lib.sync.pipe import LocalRRef, Pipe

__all__ = ["LocalRRef", "NoChunk", "Pipe", "WithDevice", "is_checkpointing",
           "is_recomputing"]
