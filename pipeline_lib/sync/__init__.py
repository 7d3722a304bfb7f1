"""``torch.distributed.pipeline.sync``, the classic pipeline API, on `pipeline_lib`.

PyTorch 2.4 removed it; code written for it runs with its imports changed::

    from torch.distributed.pipeline.sync import Pipe      # before
    from pipeline_lib.sync import Pipe                    # here

    model = Pipe(torch.nn.Sequential(*module_list), chunks=8)
    output = model(data).local_value()

`Pipe` maps the classic calling conventions onto `pipeline_lib.Pipe` (see `sync.pipe`);
``pipeline_lib.sync.skip`` holds the skip-connection names. `torch.distributed.rpc` is
not needed. New code can use `pipeline_lib.Pipe` directly, which also runs schedules
(``pipe.step``).
"""
from pipeline_lib.checkpoint import is_checkpointing, is_recomputing
from pipeline_lib.devices import WithDevice
from pipeline_lib.microbatch import NoChunk
from pipeline_lib.sync.pipe import LocalRRef, Pipe

__all__ = ["LocalRRef", "NoChunk", "Pipe", "WithDevice", "is_checkpointing",
           "is_recomputing"]
