"""A schedule of ours run by PyTorch's runtime, in each process of a job.

PyTorch runs a custom schedule with ``_PipelineScheduleRuntime``: it loads a program from
a CSV (`Schedule.to_csv`), ``compute_only`` (it lowers it itself, adding the sends and
receives) or ``compute_comms`` (run as written), and executes it over the rank's
``PipelineStage`` objects. torchtitan does the same with ``pipeline_parallel_schedule_csv``.
What the runtime needs from us, per rank:

* `stages_for`: the rank's stages, the ones the schedule places on it (looped or a V),
  cut from the model by our `partition.group_layers` with the balance `Pipe` and
  `DistributedPipe` use, so that every gradient can be compared with theirs;
* `exported`, `runtime_for`: the CSV read and checked (a ``compute_comms`` file for what
  PyTorch does not check), and the runtime over the rank's stages with it loaded;
* `run_step`: one training step of it (or of a PyTorch schedule class), inputs on the
  rank holding the first stage, targets on the one holding the last.

The job itself (``torchrun``, a process group) is the caller's: notebook 06's worker
(`pipeline_lib.course.workers.torch_pipelining`), the tests, ``bench/bench_pytorch_runtime.py``.

**On gloo.** ``dist.batch_isend_irecv`` has hung on gloo when a batch mixes sends and
receives. This runtime never forms one: each ``SEND_F``/``SEND_B`` posts the sends of one
stage and micro-batch, each ``RECV_*`` its receives, through PyTorch's ``_batch_p2p``,
which issues an all-send or all-receive batch as plain ``isend``/``irecv`` (torch 2.13).
tests/test_torch_pipelining.py counts the step's calls to ``dist.batch_isend_irecv``: none,
where PyTorch's own ``Schedule1F1B``, which fuses a send with the next receive, makes them.
(The first step's exchange of shapes sends one object at a time.)
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, NamedTuple, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.pipelining import PipelineStage

from pipeline_lib.partition import group_layers
from pipeline_lib.pytorch import private
from pipeline_lib.pytorch.notation import (Bookkeeping, compute_actions, csv_format,
                                           from_csv, read_csv)
from pipeline_lib.schedules import Schedule


def stages_for(model: nn.Sequential, balance: Sequence[int], schedule: Schedule, rank: int,
               device: torch.device, group: dist.ProcessGroup | None = None
               ) -> list[PipelineStage]:
    """This rank's ``PipelineStage`` objects, in stage order: ``group_layers(model, balance)``'s
    stages that ``schedule`` places on ``rank``, moved to ``device``. ``group``: the
    pipeline's process group (default: the world), numbered as the schedule's ranks."""
    parts = group_layers(model, balance)
    if len(parts) != schedule.stages:
        raise ValueError(f"balance {list(balance)} makes {len(parts)} stages; schedule "
                         f"{schedule.name!r} has {schedule.stages} ({schedule.ranks} ranks x "
                         f"{schedule.virtual_stages}): give {schedule.stages} entries")
    return [PipelineStage(parts[s].to(device), s, schedule.stages, device, group=group)
            for s in schedule.stages_on(rank)]


class Exported(NamedTuple):
    """A schedule CSV, read and checked (`exported`): the `Schedule` it holds (its compute
    order and placement, which `stages_for` needs before the runtime reads the file) and
    its format."""

    path: Path
    schedule: Schedule
    format: str


def exported(path: str | Path) -> Exported:
    """The schedule CSV at ``path``, validated: a ``compute_comms`` file's messages checked
    (`notation.check_messages`), and its ``REDUCE_GRAD`` actions (`check_reduce_grad`)."""
    rows = read_csv(path)
    schedule = from_csv(path)
    fmt = csv_format(rows)
    if fmt == "compute_comms":
        check_reduce_grad(rows)
    return Exported(Path(path), schedule, fmt)


def check_reduce_grad(rows: Sequence[Sequence[Any]]) -> None:
    """In a ``compute_comms`` program, each stage's ``REDUCE_GRAD`` after its last
    backward: PyTorch's runtime divides a stage's gradients by the number of micro-batches
    there and nowhere else, so a program without it trains on gradients m times too large,
    silently (a ``compute_only`` file gets them from PyTorch's lowering)."""
    for rank, row in enumerate(rows):
        last_backward: dict[int, int] = {}
        reduced: dict[int, int] = {}
        for k, token in enumerate(row):
            for a in compute_actions(token):
                if a.kind in ("B", "W"):
                    last_backward[a.stage] = k
            if isinstance(token, Bookkeeping) and token.kind == "REDUCE_GRAD":
                reduced[token.stage] = k
        for stage, k in sorted(last_backward.items()):
            if reduced.get(stage, -1) < k:
                raise ValueError(
                    f"rank {rank}: stage {stage} has no {stage}REDUCE_GRAD after its last "
                    f"backward ({row[k]}, column {k}); PyTorch's runtime divides the "
                    f"stage's gradients by the number of micro-batches only there, so they "
                    f"would be that many times too large. Add it (Schedule.to_csv writes it)")


def runtime_for(stages: Sequence[PipelineStage], csv: Exported,
                loss_fn: Callable[[Tensor, Tensor], Tensor], scale_grads: bool = True) -> Any:
    """PyTorch's ``_PipelineScheduleRuntime`` over this rank's ``stages``, with the program
    of the schedule CSV ``csv`` (`exported`) loaded in its format. ``scale_grads``: divide
    the gradients by the number of micro-batches (PyTorch's default; right for a loss
    that is a mean over the micro-batch)."""
    runtime = private.Runtime(list(stages), csv.schedule.microbatches, loss_fn=loss_fn,
                              scale_grads=scale_grads)
    runtime._load_csv(str(csv.path), format=csv.format)
    return runtime


def run_step(schedule: Any, stages: Sequence[PipelineStage], microbatches: int,
             inputs: Tensor | None, targets: Tensor | None,
             losses: list[Tensor] | None = None) -> None:
    """One forward-backward step of a PyTorch schedule (`runtime_for`'s runtime, or a
    class such as ``Schedule1F1B``) over this rank's ``stages``, in ``microbatches``
    micro-batches: the batch's ``inputs`` go to the rank that holds the first stage,
    ``targets`` to the one holding the last, which appends each micro-batch's loss to
    ``losses``; others pass None. The batch's rows must split into equal micro-batches:
    the runtime allocates its receive buffers from the first one's shape, and a smaller
    one would arrive in a buffer of the wrong size."""
    first, last = any(s.is_first for s in stages), any(s.is_last for s in stages)
    for name, batch, needed in [("inputs", inputs, first), ("targets", targets, last)]:
        if needed and batch is None:
            raise ValueError(f"this rank holds the {'first' if name == 'inputs' else 'last'} "
                             f"stage: pass the batch's {name}")
        if needed and batch.size(0) % microbatches:
            raise ValueError(f"a batch of {batch.size(0)} rows does not split into "
                             f"{microbatches} equal micro-batches, which PyTorch's runtime "
                             f"needs (its receive buffers take the first micro-batch's shape)")
    args = (inputs,) if first else ()
    kwargs = {"target": targets, "losses": losses, "return_outputs": False} if last else {}
    schedule.step(*args, **kwargs)
