"""A pipeline replicated with DistributedDataParallel, recorded rank by rank: the torchrun
job of notebook 05.

    torchrun --nproc-per-node 4 -m pipeline_lib.course.workers.ddp_pipeline WORKDIR

``WORKDIR/setup.pt`` (`write_ddp_pipeline_setup`) holds the job: the ``pp × dp`` mesh, the model's
config and weights, the balance, schedule and micro-batch count, SGD's learning rate and the
global batches. Every process trains its stage of its replica with `DistributedPipe` and
saves a `RankRecord` of what it saw (``WORKDIR/rank{r}.pt``); `read_records` loads them
in rank order. They hold what
the notebook checks:

* the rank's place in the mesh, read from the process groups themselves;
* per step, the loss of its replica's own rows (last stage only): replicas train on
  different rows, so these differ, while their parameters must not;
* every gradient all-reduce DDP ran: during which action of the schedule, at what time;
* its final parameters, under the full model's names, to compare with one process
  (clipped, if ``Setup.clip`` says so, by the whole model's norm: `pipeline_lib.grad_clip`);
* the events of its last step, to draw every rank's on one time axis.

(The cost model that grades exercise 5.1 lives with the grader, in
`pipeline_lib.course.checks.nb05`: it is the exercise's answer.)
"""
from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel

from pipeline_lib.distributed.pipe import DistributedPipe
from pipeline_lib.distributed.job import process_group
from pipeline_lib.distributed.mesh import Mesh, init_mesh
from pipeline_lib.grad_clip import clip_grad_norm_
from pipeline_lib.lm.model import transformer_lm
from pipeline_lib.timeline import Event, Timeline
from pipeline_lib.lm.loops import lm_loss
from pipeline_lib.course.workers import results

RESULTS = "rank"   # each process saves WORKDIR/rank{rank}.pt


@dataclass
class Setup:
    """One job: every rank reads the same, so every rank builds the same pipeline."""

    pp: int
    dp: int
    model_config: dict[str, Any]        # transformer_lm(**model_config)
    state_dict: dict[str, Tensor]       # the initial weights
    balance: list[int]
    microbatches: int                   # per replica
    schedule: str
    lr: float                           # plain SGD: one process gets lr x the same gradient
    batches: list[tuple[Tensor, Tensor]]  # global (inputs, targets); replicas split the rows
    clip: float | None = None           # max gradient norm of the whole model, or no clipping
    order: str = "replica-major"        # how global ranks fill the grid: `init_mesh`'s order


@dataclass
class AllReduce:
    """DDP's communication hook fired on ``rank``: ``bucket`` of ``stage``'s gradients was
    averaged over its DDP group."""

    rank: int
    step: int
    stage: int
    bucket: int
    action: str      # the schedule action running on this rank at that moment, e.g. "0B3"
    time: float      # when it started, on the mesh clock, shared by all ranks
    end: float       # when its result was ready, on the same clock


@dataclass
class RankRecord:
    rank: int
    replica: int
    pipe_rank: int
    pipeline: list[int]          # global ranks of this rank's pipeline group, first stage first
    dp_group: list[int]          # global ranks of its DDP group (the same stages)
    replica_losses: list[float]  # per step, this replica's rows' loss (last stage; else [])
    losses: list[float]          # per step, the global batch's loss (last stage; else [])
    all_reduces: list[AllReduce]
    grad_norms: list[float]      # per step, the whole model's gradient norm before clipping
    #                              (what `clip_grad_norm_` found on this rank); [] unclipped
    parameters: dict[str, Tensor]
    last_step: list[Event]
    clock_spread: float          # the most by which its clock and another rank's disagree


def write_ddp_pipeline_setup(workdir: str | Path, setup: Setup) -> Path:
    """Save the job; the records of an earlier job in ``workdir`` are removed."""
    return results.write_setup(workdir, RESULTS, setup)


def read_records(workdir: str | Path) -> list[RankRecord]:
    """Every rank's record, in rank order."""
    setup = torch.load(Path(workdir) / "setup.pt")
    command = f"torchrun --nproc-per-node {setup['pp'] * setup['dp']} -m {__name__} {workdir}"
    records = []
    for saved in results.load(workdir, RESULTS, command):
        saved["all_reduces"] = [AllReduce(**a) for a in saved["all_reduces"]]
        saved["last_step"] = Timeline.from_dict(saved["last_step"]).events
        records.append(RankRecord(**saved))
    return records


def last_step_timeline(records: Sequence[RankRecord]) -> tuple[Timeline, list[AllReduce]]:
    """Every rank's last step on one time axis, starting at 0, and the all-reduces that ran
    in it on the same axis: the ranks' clocks all started at one barrier."""
    events = [e for r in records for e in r.last_step]
    t0 = min(e.start for e in events)
    last = max(a.step for r in records for a in r.all_reduces)
    syncs = [AllReduce(a.rank, a.step, a.stage, a.bucket, a.action, a.time - t0, a.end - t0)
             for r in records for a in r.all_reduces if a.step == last]
    return Timeline(len(records), events).shifted(), syncs


# -- the worker --------------------------------------------------------------------------------

class ReplicaLoss:
    """`lm_loss`, also keeping each micro-batch's loss and token count: ``pipe.step`` returns
    the global batch's loss, and this replica's share of it is what tells replicas apart."""

    def __init__(self) -> None:
        self.parts: list[tuple[float, int]] = []

    def __call__(self, logits: Tensor, target: Tensor) -> Tensor:
        loss = lm_loss(logits, target)
        self.parts.append((loss.item(), target.numel()))
        return loss

    def take(self) -> float:
        """The token-weighted mean over the micro-batches seen since the last call."""
        tokens = sum(n for _, n in self.parts)
        mean = sum(loss * n for loss, n in self.parts) / tokens
        self.parts.clear()
        return mean


def _record_all_reduces(pipe: DistributedPipe, mesh: Mesh, log: list[list[float]]) -> None:
    """Register a DDP communication hook on each replicated stage that runs DDP's own
    all-reduce (the average over the DDP group) and logs [stage, bucket, start, end]: the
    end is filled in when the all-reduce's future completes, so the notebook can show how
    much of it no computation hid."""
    for stage, module in pipe.modules.items():
        if not isinstance(module, DistributedDataParallel):
            continue

        # Not annotated: DDP checks the hook's annotations against dist.GradBucket and
        # torch.futures.Future, which the string annotations of this module never equal.
        def hook(group, bucket, stage=stage):  # type: ignore[no-untyped-def]
            entry = [stage, bucket.index(), mesh.clock(), float("nan")]
            log.append(entry)

            def finished(future):  # type: ignore[no-untyped-def]
                entry[3] = mesh.clock()
                return future.value()

            return allreduce_hook(group, bucket).then(finished)

        module.register_comm_hook(mesh.dp_group, hook)


def _action_at(events: Sequence[Event], time: float) -> str:
    return next((str(e.action) for e in events if e.start <= time <= e.end), "between actions")


def train_and_record(setup: Setup, mesh: Mesh) -> RankRecord:
    """Train this rank's share of the job, recording what happened."""
    model = transformer_lm(**setup.model_config)
    model.load_state_dict(setup.state_dict)
    names = {id(p): name for name, p in model.named_parameters()}
    pipe = DistributedPipe(model, mesh, setup.balance, setup.microbatches, setup.schedule)
    optimizer = torch.optim.SGD(pipe.parameters(), lr=setup.lr)
    hooked: list[list[float]] = []
    _record_all_reduces(pipe, mesh, hooked)
    loss_fn = ReplicaLoss()
    replica_losses, losses, all_reduces, grad_norms = [], [], [], []
    for step, (inputs, targets) in enumerate(setup.batches):
        optimizer.zero_grad(set_to_none=True)
        loss = pipe.step(inputs, targets, loss_fn)
        if setup.clip is not None:     # the whole model's norm: summed over the pipeline
            grad_norms.append(clip_grad_norm_(pipe, setup.clip).item())
        optimizer.step()
        if loss is not None:
            losses.append(loss.item())
            replica_losses.append(loss_fn.take())
        all_reduces += [AllReduce(mesh.rank, step, int(stage), int(bucket),
                                  _action_at(pipe.events, start), start, end)
                        for stage, bucket, start, end in hooked]
        hooked.clear()
    return RankRecord(
        rank=mesh.rank, replica=mesh.replica, pipe_rank=mesh.pipe_rank,
        pipeline=(dist.get_process_group_ranks(mesh.pipe_group) if mesh.pipe_group
                  else [mesh.rank]),
        dp_group=dist.get_process_group_ranks(mesh.dp_group) if mesh.dp_group else [mesh.rank],
        replica_losses=replica_losses, losses=losses, all_reduces=all_reduces,
        grad_norms=grad_norms,
        parameters={names[id(p)]: p.detach().cpu().clone() for p in pipe.parameters()},
        last_step=pipe.events, clock_spread=mesh.clock_spread)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Train the pipeline of WORKDIR/setup.pt, "
                                     "replicated with DDP, and record what each rank did")
    parser.add_argument("workdir", type=Path)
    parser.add_argument("--timeout", type=float, default=120.0,
                        help="seconds any single wait may take before it is an error")
    args = parser.parse_args(argv)
    setup = Setup(**torch.load(args.workdir / "setup.pt"))
    with process_group(timeout=args.timeout):
        mesh = init_mesh(setup.pp, setup.dp, args.timeout, setup.order)
        results.start_run(args.workdir, RESULTS)
        record = train_and_record(setup, mesh)
        saved = asdict(record)
        saved["last_step"] = Timeline(setup.pp * setup.dp, record.last_step).to_dict()
        results.save(args.workdir, RESULTS, saved)


if __name__ == "__main__":
    main()
