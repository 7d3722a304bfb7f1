"""pipeline_lib: pipeline parallelism you can read, run on a laptop, and scale to GPUs.

One schedule representation, two executors. The core, at this level:

* `schedules`: a `Schedule` is an ordered list of `Action`s per rank (``0F1`` = forward of
  micro-batch 1 on stage 0); builders for GPipe, 1F1B, interleaved 1F1B, zero-bubble;
* `timeline`: `simulate` a schedule into a `Timeline`, the same type a real run records;
* `partition`: where to cut an ``nn.Sequential`` into stages (by parameters, time, memory),
  with `memory` measuring what autograd saves;
* `microbatch`: split a batch into micro-batches, gather the outputs, scale the loss;
* `lowering`: a schedule (and the skip connections of a split) compiled once into each
  rank's program of compute actions and the messages they receive and send;
* `executor`: `run_program`, the one loop both executors run over a lowered program
  (receive, compute with the stage's runner, send) behind a transport that moves keyed
  messages; `step`: the split, loss weights and gradient commit around it;
* `stage`: `StageRunner`, what one stage does for each action (F, B, I, W), used by both
  executors; with `split_backward` (W resumes where I stopped), `checkpoint` (recompute activations), `rng` (dropout that replays),
  `skip` (skip connections across stages), `batchnorm` and `devices`.

The executors, one package each, run the same `Schedule`:

* `threaded`: one process, one thread per stage/device: `Pipe`;
* `distributed`: one process per rank on ``torch.distributed``: `DistributedPipe`, with its
  transport (`p2p`), process layout (`mesh`) and ``torchrun`` launcher (`launch`).

`sync` is the classic ``torch.distributed.pipeline.sync.Pipe`` API (removed from PyTorch in
2.4) as a thin layer over `Pipe`, so old tutorial code runs with its import changed.

`course` holds what the notebooks use and a pipeline does not need: `exercises` (the
checks), `speed` (a measured step taken apart: is the pipeline faster, and why not),
`data_parallel` (``nn.DataParallel`` from its four primitives), `pytorch_schedules`
(PyTorch's schedules as ours, to compare) and `workers` (code that only one notebook's
``torchrun`` workers run). Around the core: `viz` (Gantt charts and the README's
figures) and `lm` (the Transformer language model, WikiText-2 and its training program).
"""
from pipeline_lib import _moved
from pipeline_lib.batchnorm import DeferredBatchNorm
from pipeline_lib.checkpoint import is_checkpointing, is_recomputing
from pipeline_lib.devices import WithDevice
from pipeline_lib.loss import SumCount
from pipeline_lib.microbatch import NoChunk
from pipeline_lib.schedules import Action, Schedule, ScheduleError, validate
from pipeline_lib.skip import Namespace, SkipError, pop, skippable, stash, verify_skips
from pipeline_lib.threaded import Pipe, PipelineAborted
from pipeline_lib.timeline import Event, Timeline, bubble_theory, simulate

__all__ = [
    "Action", "DeferredBatchNorm", "Event", "Namespace", "NoChunk", "Pipe",
    "PipelineAborted", "Schedule", "ScheduleError", "SkipError", "SumCount", "Timeline",
    "WithDevice",
    "bubble_theory", "gantt", "is_checkpointing", "is_recomputing", "pop", "simulate",
    "skippable", "stash", "validate", "verify_skips",
]


_moved.install()


def __getattr__(name: str):
    """`gantt` is imported on first use: matplotlib is slow to import, and torchrun
    workers, which import this package, never draw."""
    if name == "gantt":
        from pipeline_lib.viz.plot import gantt
        return gantt
    raise AttributeError(f"module 'pipeline_lib' has no attribute {name!r}")
