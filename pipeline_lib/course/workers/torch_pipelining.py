"""Our Transformer LM on PyTorch's own pipeline runtime, `torch.distributed.pipelining`.

Everything `Pipe.step` does by hand, PyTorch does with three objects: a *stage* (the
layers one rank holds, as a `PipelineStage`), a *schedule* (`ScheduleGPipe`,
`Schedule1F1B`, ...) that splits the batch into micro-batches and runs the stage's
forwards and backwards in its order, and a process group whose point-to-point messages
carry activations and gradients between ranks. A stage is cut out of the model in one of
two ways:

* **manual**: each rank builds the whole model and keeps only its own layers
  (`manual_split`), as torchtitan does;
* **tracer**: `pipeline()` traces the model with ``torch.export`` and cuts the graph at
  `SplitPoint`s (`split_spec`); each rank builds its stage from the traced pipe.

This file is also the torchrun worker that runs them and writes what happened::

    torchrun --nproc-per-node 2 -m pipeline_lib.course.workers.torch_pipelining WORKDIR \\
        --runs gpipe:manual,1f1b:tracer --microbatches 4

With ``--csv A.csv,B.csv`` it runs (after the ``--runs``, in the same job) schedules
exported from ours (`Schedule.to_csv`) on PyTorch's ``_PipelineScheduleRuntime``
(`pipeline_lib.pytorch.runner`), each CSV in turn, every stage cut by our `group_layers`
with ``setup.pt``'s balance for that many stages; `read_csv_run` reads one back.

With ``--mesh PPxDP`` (and ``--nproc-per-node PP*DP``) it runs, last, one 1F1B step of
DP replicas of a PP-stage pipeline (`mesh_step`): the stages built on the meta device
then materialised, `PipelineStage(..., group=)` on a device mesh's pipeline group, the
gradients averaged over its data-parallel group. What is asked runs in one job, so the
processes start once.

``WORKDIR/setup.pt`` (`write_pipelining_setup`) holds the model's config and weights and
one batch;
every run starts from those weights and leaves, per rank, the micro-batch losses, the
gradients of the rank's parameters, the timeline of its forwards and backwards and the
wall-clock start and end of its last step (`read_run` puts the ranks back together).
(`pipeline_lib.course.pytorch_schedules` turns the action order PyTorch describes for a
schedule into our `Schedule`, to simulate and draw it.)
"""
from __future__ import annotations

import argparse
import time
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe,
                                          SplitPoint, pipeline)
from torch.distributed.device_mesh import init_device_mesh

from pipeline_lib.distributed.launch import worker_device
from pipeline_lib.distributed.job import process_group
from pipeline_lib.lm.model import Embedding, transformer_lm
from pipeline_lib.course import pytorch_schedules
from pipeline_lib.pytorch import private
from pipeline_lib.pytorch.runner import Exported, exported, run_step, runtime_for, stages_for
from pipeline_lib.schedules import Action, Schedule
from pipeline_lib.timeline import Event, Timeline
from pipeline_lib.lm.loops import lm_loss
from pipeline_lib.course.workers import results

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
# copies of notebook 06 handed out before it moved to pipeline_lib.course.pytorch_schedules
# import it from here
pytorch_schedule = pytorch_schedules.pytorch_schedule
SPLITS = ("manual", "tracer")
RESULTS = "rank"   # each process saves WORKDIR/SCHEDULE-SPLIT/rank{rank}.pt


# -- the two ways to cut a stage out of the model --------------------------------------

def _check_balance(model: nn.Sequential, balance: Sequence[int]) -> None:
    if any(b < 1 for b in balance) or sum(balance) != len(model):
        raise ValueError(f"balance {list(balance)} must be positive layer counts adding up "
                         f"to the model's {len(model)} layers")


def manual_split(model: nn.Sequential, balance: Sequence[int], stage: int) -> nn.Sequential:
    """The layers of ``stage``, under the names they have in ``model``.

    Keeping the names ("2", "3", ... rather than renumbering from "0") means the full
    model's state dict, and gradients keyed by parameter name, line up with every stage.
    """
    _check_balance(model, balance)
    if not 0 <= stage < len(balance):
        raise ValueError(f"stage {stage} does not exist: balance {list(balance)} makes "
                         f"{len(balance)} stages")
    start = sum(balance[:stage])
    names = [str(i) for i in range(start, start + balance[stage])]
    return nn.Sequential(OrderedDict((name, model[int(name)]) for name in names))


def split_spec(balance: Sequence[int]) -> dict[str, SplitPoint]:
    """For `pipeline()`: cut just before the first layer of every stage but the first."""
    starts = [sum(balance[:k]) for k in range(1, len(balance))]
    return {str(layer): SplitPoint.BEGINNING for layer in starts}


def make_stage(model: nn.Sequential, balance: Sequence[int], split: str, rank: int,
               example_microbatch: Tensor, device: torch.device) -> private.StageBase:
    """This rank's `PipelineStage` on ``device``, cut out ``split``-wise ("manual" or
    "tracer"). ``model`` and the example must already be on ``device``.

    The traced graph is specialised to the example's shape: every micro-batch must have
    the shape of ``example_microbatch``.
    """
    _check_balance(model, balance)
    if split == "manual":
        return PipelineStage(manual_split(model, balance, rank), rank, len(balance), device)
    if split == "tracer":
        traced = pipeline(model, mb_args=(example_microbatch,),
                          split_spec=split_spec(balance))
        return traced.build_stage(rank, device)
    raise ValueError(f"unknown split {split!r}; choose one of {SPLITS}")


def materialize(stage: nn.Module, state_dict: dict[str, Tensor], d_model: int,
                device: torch.device) -> nn.Module:
    """A stage built on the ``meta`` device (shapes only, no memory), given memory on
    ``device`` and its weights from ``state_dict`` (the full model's, names as in
    `manual_split`).

    ``to_empty`` allocates without initialising, and a checkpoint holds only persistent
    tensors: the embedding's position table (``pe``, a buffer its constructor computes)
    would stay garbage, so it is recomputed, from a one-token `Embedding` of the same width.
    """
    stage.to_empty(device=device)
    own = stage.state_dict().keys()
    stage.load_state_dict({name: state_dict[name] for name in own})
    for module in stage.modules():
        if isinstance(module, Embedding):
            module.pe.copy_(Embedding(1, d_model, 0.0, module.pe.size(0)).pe)
    return stage


# -- watching the runtime ----------------------------------------------------------------

def record_actions(stage: private.StageBase, events: list[Event]) -> None:
    """Log every forward and backward (B, I and W) the schedule runs on ``stage`` as one
    of our `Event`s, so PyTorch's run becomes a `Timeline` we can draw and check.

    Single-stage schedules do not execute their ``pipeline_order``: they run hand-written
    loops, and this shows what those loops really did. Times are wall clock
    (``time.time``), comparable between processes on one machine.
    """
    rank = dist.get_rank()
    forward, backward = stage.forward_one_chunk, stage.backward_one_chunk

    def log(kind: str, microbatch: int, start: float) -> None:
        events.append(Event(rank, Action(stage.stage_index, kind, microbatch),
                            start, time.time()))

    def forward_one_chunk(fwd_chunk_id: int, args: tuple[Any, ...],
                          kwargs: dict[str, Any] | None = None,
                          save_forward_output: bool = True) -> Any:
        start = time.time()
        output = forward(fwd_chunk_id, args, kwargs, save_forward_output)
        log("F", fwd_chunk_id, start)
        return output

    def backward_one_chunk(bwd_chunk_id: int, loss: Tensor | None = None,
                           full_backward: bool = True, last_backward: bool = False) -> None:
        start = time.time()
        backward(bwd_chunk_id, loss=loss, full_backward=full_backward,
                 last_backward=last_backward)
        log("B" if full_backward else "I", bwd_chunk_id, start)

    def backward_weight_one_chunk(bwd_chunk_id: int, last_backward: bool = False,
                                  **kwargs: Any) -> None:
        start = time.time()
        weight(bwd_chunk_id, last_backward=last_backward, **kwargs)
        log("W", bwd_chunk_id, start)

    weight = stage.backward_weight_one_chunk
    stage.forward_one_chunk = forward_one_chunk
    stage.backward_one_chunk = backward_one_chunk
    stage.backward_weight_one_chunk = backward_weight_one_chunk


# -- what a notebook hands the workers, and what it gets back -----------------------------

def write_pipelining_setup(workdir: str | Path, model_config: dict[str, Any],
                           model: nn.Module, inputs: Tensor, targets: Tensor,
                           balance: Sequence[int],
                           balances: Sequence[Sequence[int]] = ()) -> Path:
    """Save what every run starts from: ``transformer_lm(**model_config)`` with
    ``model``'s weights, one batch, and the layers per stage: ``balance`` for the named
    schedules' runs, and for the ``--csv`` runs the one of ``balance`` and ``balances``
    with as many entries as the schedule has stages. The results of earlier runs in
    ``workdir`` are removed."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    for schedule in SCHEDULES:
        for split in SPLITS:
            results.clear(_folder(workdir, schedule, split), RESULTS)
    results.clear(workdir / MESH, RESULTS)
    for folder in workdir.glob(f"{CSV_PREFIX}*"):
        results.clear(folder, RESULTS)
    path = workdir / "setup.pt"
    by_stages = {len(b): list(b) for b in (balance, *balances)}
    torch.save({"model_config": model_config, "state_dict": model.state_dict(),
                "inputs": inputs, "targets": targets, "balance": list(balance),
                "balances": by_stages}, path)
    return path


def load_model(setup: dict[str, Any]) -> nn.Sequential:
    model = transformer_lm(**setup["model_config"])
    model.load_state_dict(setup["state_dict"])
    return model


@dataclass
class RunResult:
    """One run of PyTorch's pipeline, all ranks together."""

    microbatch_losses: list[float]
    grads: dict[str, Tensor]
    timeline: Timeline
    step_seconds: float    # the last step's wall time: first rank's start to last rank's end
    batch_isend_irecv: list[int]   # per rank, its calls to dist.batch_isend_irecv in that step

    @property
    def loss(self) -> float:
        """The batch loss as PyTorch's scaling defines it: the mean of micro-batch means."""
        return sum(self.microbatch_losses) / len(self.microbatch_losses)

    def executed(self) -> Schedule:
        """The order in which each rank really ran its actions, as a `Schedule`."""
        ranks = self.timeline.ranks
        actions = [[e.action for e in sorted(self.timeline.events, key=lambda e: e.start)
                    if e.rank == rank] for rank in range(ranks)]
        return Schedule(self.timeline.title, ranks, len(self.microbatch_losses), actions)


def _folder(workdir: str | Path, schedule: str, split: str) -> Path:
    return Path(workdir) / f"{schedule}-{split}"


def read_run(workdir: str | Path, schedule: str, split: str) -> RunResult:
    """The last run of ``schedule`` with ``split``, every rank's part in rank order."""
    folder = _folder(workdir, schedule, split)
    parts = results.load(folder, RESULTS, f"torchrun --nproc-per-node 2 -m {__name__} "
                                          f"{workdir} --runs {schedule}:{split}")
    title = f"torch.distributed.pipelining {SCHEDULES[schedule].__name__} ({split} split)"
    return _run_result(parts, title)


def _run_result(parts: list[dict[str, Any]], title: str) -> RunResult:
    losses = [loss for part in parts for loss in part["losses"]]
    grads = {name: g for part in parts for name, g in part["grads"].items()}
    events = [e for part in parts for e in Timeline.from_dict(part["timeline"]).events]
    step = (max(part["step"][1] for part in parts) - min(part["step"][0] for part in parts))
    return RunResult(losses, grads, Timeline(len(parts), events, "s", title), step,
                     [part["batch_isend_irecv"] for part in parts])


CSV_PREFIX = "csv-"   # a --csv run's results: WORKDIR/csv-{the file's stem}/rank{rank}.pt


def _csv_folder(workdir: str | Path, csv: str | Path) -> Path:
    return Path(workdir) / f"{CSV_PREFIX}{Path(csv).stem}"


def read_csv_run(workdir: str | Path, csv: str | Path) -> RunResult:
    """The last ``--csv`` run of the schedule in ``csv``, every rank's part in rank order."""
    parts = results.load(_csv_folder(workdir, csv), RESULTS,
                         f"torchrun -m {__name__} {workdir} --csv {csv}")
    return _run_result(parts, f"PyTorch's _PipelineScheduleRuntime running {Path(csv).name}")


@contextmanager
def counting_batch_isend_irecv() -> Iterator[list[int]]:
    """``dist.batch_isend_irecv`` counted while the block runs (the list gets one entry,
    the batch's size, per call): the call that has hung on gloo when a batch mixes sends
    and receives. PyTorch's ``_batch_p2p`` reaches it as ``dist.batch_isend_irecv``."""
    original, calls = dist.batch_isend_irecv, []

    def counted(ops: list[Any]) -> Any:
        calls.append(len(ops))
        return original(ops)

    dist.batch_isend_irecv = counted
    try:
        yield calls
    finally:
        dist.batch_isend_irecv = original


# -- the torchrun worker ------------------------------------------------------------------

def _run(setup: dict[str, Any], schedule: str, split: str, microbatches: int,
         steps: int, device: torch.device) -> dict[str, Any]:
    """Run ``steps`` forward-backward steps from the saved weights (no optimizer: every
    step computes the same gradients); report the last one, whose stages have warmed up
    (the first step also works out the shapes of the messages between stages)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    balance = setup["balance"]
    if len(balance) != world:
        raise ValueError(f"balance {balance} makes {len(balance)} stages but torchrun "
                         f"started {world} processes; use --nproc-per-node {len(balance)}")
    inputs, targets = setup["inputs"].to(device), setup["targets"].to(device)
    if inputs.size(0) % microbatches:
        raise ValueError(f"a batch of {inputs.size(0)} rows does not split into "
                         f"{microbatches} equal micro-batches, which the traced graph and "
                         f"PyTorch's loss scaling both assume")
    model = load_model(setup).to(device)
    example = inputs.tensor_split(microbatches)[0]
    stage = make_stage(model, balance, split, rank, example, device)
    runner = SCHEDULES[schedule](stage, microbatches, loss_fn=lm_loss)
    events: list[Event] = []
    record_actions(stage, events)
    losses: list[Tensor] = []      # the last stage's schedule fills it in every step
    return _last_step(lambda: run_step(runner, [stage], microbatches, inputs, targets, losses),
                      stage.submod, events, losses, steps)


def _last_step(step: Callable[[], None], module: nn.Module, events: list[Event],
               losses: list[Tensor], steps: int) -> dict[str, Any]:
    """``steps`` steps of ``step`` from the same weights (no optimizer: every step computes
    the same gradients), the ranks starting each together; the last one's micro-batch
    losses, wall-clock start and end (comparable between the processes), the gradients
    of ``module``'s parameters, the recorded ``events`` and the number of
    ``batch_isend_irecv`` calls."""
    for _ in range(steps):
        module.zero_grad(set_to_none=True)
        events.clear()
        dist.barrier()
        start = time.time()
        with counting_batch_isend_irecv() as calls:
            step()
        wall = (start, time.time())
    return {"losses": [loss.item() for loss in losses], "step": wall,
            "grads": {name: p.grad.cpu() for name, p in module.named_parameters()
                      if p.grad is not None},
            "timeline": Timeline(dist.get_world_size(), events).to_dict(),
            "batch_isend_irecv": len(calls)}


def _run_csv(setup: dict[str, Any], csv: Exported, steps: int,
             device: torch.device) -> dict[str, Any]:
    """`_run` for a schedule CSV: this rank's stages of it on PyTorch's runtime, ``steps``
    steps from the saved weights, the last one reported."""
    rank, world = dist.get_rank(), dist.get_world_size()
    schedule = csv.schedule
    if schedule.ranks != world:
        raise ValueError(f"{csv.path.name} has programs for {schedule.ranks} ranks but "
                         f"torchrun started {world} processes; use --nproc-per-node "
                         f"{schedule.ranks}")
    balance = setup["balances"].get(schedule.stages)
    if balance is None:
        raise ValueError(f"{csv.path.name} has {schedule.stages} stages and setup.pt has "
                         f"balances for {sorted(setup['balances'])}: pass one of "
                         f"{schedule.stages} entries in write_pipelining_setup(..., balances=)")
    model = load_model(setup)
    stages = stages_for(model, balance, schedule, rank, device)
    runtime = runtime_for(stages, csv, lm_loss)
    events: list[Event] = []
    for stage in stages:
        record_actions(stage, events)
    inputs, targets = setup["inputs"].to(device), setup["targets"].to(device)
    losses: list[Tensor] = []
    return _last_step(lambda: run_step(runtime, stages, schedule.microbatches, inputs, targets,
                                       losses), model, events, losses, steps)


MESH = "mesh"   # mesh_step's results: WORKDIR/mesh/rank{rank}.pt


def mesh_step(setup: dict[str, Any], pp: int, dp: int, microbatches: int,
              device: torch.device) -> dict[str, Any]:
    """One Schedule1F1B step on ``dp`` replicas of a ``pp``-stage pipeline; this rank's
    gradients after the data-parallel average, and the ranks of its two groups.

    Global rank = replica × pp + pipe rank (`init_device_mesh` with the ``dp`` dimension
    first). Each replica takes its share of the batch's rows; the stage's peers are its
    pipeline group's ranks (``group=``), the average runs over the data-parallel group.
    """
    if len(setup["balance"]) != pp:
        raise ValueError(f"balance {setup['balance']} makes {len(setup['balance'])} stages, "
                         f"not pp = {pp}")
    rows = setup["inputs"].size(0)
    if rows % (dp * microbatches):
        raise ValueError(f"a batch of {rows} rows does not split into {dp} replicas of "
                         f"{microbatches} equal micro-batches: the average of the replicas' "
                         f"mean losses is the batch's mean only with equal shares; choose "
                         f"--microbatches and dp so that dp × microbatches divides {rows}")
    mesh = init_device_mesh(device.type, (dp, pp), mesh_dim_names=("dp", "pp"))
    pp_group, dp_group = mesh.get_group("pp"), mesh.get_group("dp")
    replica, pipe_rank = mesh.get_local_rank("dp"), mesh.get_local_rank("pp")
    with torch.device("meta"):                 # shapes only: nothing allocated
        whole = transformer_lm(**setup["model_config"])
    module = materialize(manual_split(whole, setup["balance"], pipe_rank),
                         setup["state_dict"], setup["model_config"]["d_model"], device)
    stage = PipelineStage(module, pipe_rank, pp, device, group=pp_group)
    runner = Schedule1F1B(stage, microbatches, loss_fn=lm_loss)
    inputs = setup["inputs"].tensor_split(dp)[replica].to(device)
    targets = setup["targets"].tensor_split(dp)[replica].to(device)
    run_step(runner, [stage], microbatches, inputs, targets)
    grads = {}
    for name, parameter in module.named_parameters():
        dist.all_reduce(parameter.grad, group=dp_group)   # the sum over replicas ...
        grads[name] = (parameter.grad / dp).cpu()         # ... into their mean
    return {"grads": grads, "replica": replica, "pipe_rank": pipe_rank,
            "pipeline_group": dist.get_process_group_ranks(pp_group),
            "data_group": dist.get_process_group_ranks(dp_group)}


def read_mesh_step(workdir: str | Path, pp: int, dp: int) -> list[dict[str, Any]]:
    """`mesh_step`'s results, one per global rank."""
    return results.load(Path(workdir) / MESH, RESULTS,
                        f"torchrun --nproc-per-node {pp * dp} -m {__name__} {workdir} "
                        f"--mesh {pp}x{dp}")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("workdir", type=Path,
                        help="folder with setup.pt (write_pipelining_setup)")
    parser.add_argument("--runs", default=None,
                        help="comma-separated schedule:split pairs, schedule in "
                             f"{sorted(SCHEDULES)}, split in {SPLITS} (1f1b:manual if "
                             f"neither --csv nor --mesh is given)")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--csv", default=None, metavar="A.csv,B.csv",
                        help="after --runs: schedule CSVs (Schedule.to_csv) to run on "
                             "PyTorch's _PipelineScheduleRuntime, one after the other")
    parser.add_argument("--mesh", default=None, metavar="PPxDP",
                        help="last: one 1F1B step of DP replicas of a PP-stage pipeline "
                             "(launch PP*DP processes)")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.microbatches < 1:
        parser.error("--steps and --microbatches must be at least 1")
    if args.runs is None and args.csv is None and args.mesh is None:
        args.runs = "1f1b:manual"
    runs = [] if args.runs is None else [tuple(run.split(":")) for run in args.runs.split(",")]
    for run in runs:
        if len(run) != 2 or run[0] not in SCHEDULES or run[1] not in SPLITS:
            parser.error(f"--runs: {':'.join(run)!r} is not schedule:split with schedule "
                         f"in {sorted(SCHEDULES)} and split in {SPLITS}")
    if not (args.workdir / "setup.pt").exists():
        parser.error(f"{args.workdir} has no setup.pt: write one with "
                     f"write_pipelining_setup()")
    if args.mesh is not None:
        pp, _, dp = args.mesh.partition("x")
        if not (pp.isdigit() and dp.isdigit() and int(pp) >= 1 and int(dp) >= 1):
            parser.error(f"--mesh {args.mesh!r}: write PPxDP, e.g. 2x2")
    csvs = []
    for csv in [] if args.csv is None else args.csv.split(","):
        try:                        # read and checked before any rank waits for another
            csvs.append(exported(csv))
        except (OSError, ValueError) as error:
            parser.error(f"--csv {csv}: {error}")
    setup = torch.load(args.workdir / "setup.pt")
    device = worker_device()
    with process_group():                       # one job: every process started once
        for schedule, split in runs:
            _saved(_folder(args.workdir, schedule, split),
                   lambda: _run(setup, schedule, split, args.microbatches, args.steps, device))
        for csv in csvs:
            _saved(_csv_folder(args.workdir, csv.path),
                   lambda: _run_csv(setup, csv, args.steps, device))
        if args.mesh is not None:
            _saved(args.workdir / MESH,
                   lambda: mesh_step(setup, int(pp), int(dp), args.microbatches, device))


def _saved(folder: Path, run: Callable[[], dict[str, Any]]) -> None:
    """``run()``'s result saved as this rank's part in ``folder``, an earlier run's parts
    removed first."""
    folder.mkdir(exist_ok=True)
    results.start_run(folder, RESULTS)
    results.save(folder, RESULTS, run())

if __name__ == "__main__":
    main()
