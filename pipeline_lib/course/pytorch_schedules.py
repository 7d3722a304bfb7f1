"""PyTorch's own schedules as our `Schedule`, to validate, simulate and draw beside ours.

`torch.distributed.pipelining` (2.13) describes each schedule as a list of actions per
rank, written as we write them (``0F1``: stage 0, forward, micro-batch 1). Its schedule
visualiser (private, `get_schedule_ops`) builds those lists without starting processes;
`pytorch_schedule` keeps their compute actions, in order. Two things need translating:

* **placement**: ZBVZeroBubble and DualPipeV put stages in a V, which becomes the
  schedule's ``placement``;
* **overlapped pairs**: DualPipeV's ``(0F3;3B1)`` runs a forward and a backward of two
  chunks at once, to hide one's communication under the other's compute. Our executors
  run one action at a time, so a pair becomes its forward, then its backward; the pairs
  are kept in ``meta["overlapped"]``.
"""
from __future__ import annotations

import logging
import warnings

import torch

from pipeline_lib.schedules import LOOPED, Action, Schedule, build, validate
from pipeline_lib.timeline import simulate, summary

# our builder's name -> PyTorch's schedule
PYTORCH_NAMES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved_1f1b": "Interleaved1F1B",
                 "looped_bfs": "LoopedBFS", "interleaved_zero_bubble": "InterleavedZeroBubble",
                 "zb_v": "ZBVZeroBubble", "dualpipe_v": "DualPipeV"}
_KINDS = {"FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W"}


def get_schedule_ops(*args, **kwargs) -> list:
    """PyTorch's private schedule visualiser (``get_schedule_ops`` of 2.13), called with
    ``args``; a private API may vanish from a release, so its absence is an ImportError
    that says which torch has it, not a bare module-not-found."""
    try:
        from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops as ops
    except ImportError as exc:
        raise ImportError(
            f"torch.distributed.pipelining._schedule_visualizer.get_schedule_ops, a private "
            f"PyTorch API that pipeline_lib.course.pytorch_schedules and notebook 06 use, is missing "
            f"from torch {torch.__version__}: install the torch this suite is tested with, "
            f"pip install torch==2.13.0 (see requirements.txt)") from exc
    return ops(*args, **kwargs)


def _pytorch_ops(name: str, ranks: int, microbatches: int, virtual_stages: int | None) -> list:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")          # it warns that it is a private API
        logger = logging.getLogger("torch.distributed.pipelining.schedules")
        level = logger.level
        logger.setLevel(logging.ERROR)           # and about the idle slots it adds
        try:
            return get_schedule_ops(name, ranks, microbatches, virtual_stages)
        finally:
            logger.setLevel(level)


def pytorch_schedule(name: str, ranks: int, microbatches: int,
                     virtual_stages: int | None = None) -> Schedule:
    """The order in which PyTorch's schedule ``name`` ("GPipe", "1F1B", "Interleaved1F1B",
    "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV") runs each rank's
    actions, as a `Schedule`. Not validated: call `validate` on it. PyTorch's own errors
    (a micro-batch count it does not support) pass through.

    Idle slots (None) and non-compute actions (sends, receives, REDUCE_GRAD) are dropped;
    overlapped pairs are split, forward first (see the module docstring).
    """
    actions: list[list[Action]] = []
    overlapped: list[tuple[Action, Action]] = []
    for order in _pytorch_ops(name, ranks, microbatches, virtual_stages):
        program: list[Action] = []
        for op in order:
            if op is None:
                continue
            parts = op.sub_actions or (op,)
            mine = [Action(a.stage_index, _KINDS[a.computation_type.name], a.microbatch_index)
                    for a in parts if a.computation_type.name in _KINDS]
            if len(mine) == 2:
                overlapped.append((mine[0], mine[1]))
            program += mine
        actions.append(program)
    where = {a.stage: r for r, program in enumerate(actions) for a in program}
    stages = max(where) + 1
    placement = tuple(where.get(s, -1) for s in range(stages))
    return Schedule(f"PyTorch {name}", ranks, microbatches, actions,
                    virtual_stages=stages // ranks,
                    placement=None if placement == tuple(s % ranks for s in range(stages))
                    else placement,
                    meta={"overlapped": overlapped} if overlapped else {})


def side_by_side(ranks: int, microbatches: int, virtual_stages: int = 2,
                 forward: float = 1.0, backward: float = 2.0, weight: float | None = None,
                 comm: float = 0.0) -> list[dict]:
    """Ours and PyTorch's version of every schedule PyTorch has, simulated with the same
    costs, as `summary` rows with ``source`` ("ours" or "pytorch") and ``builder``; a
    schedule PyTorch refuses for these sizes or that does not `validate` gets a row with
    ``error`` instead. Costs are per stage: multi-chunk schedules get 1/v of them."""
    rows = []
    for builder, theirs in PYTORCH_NAMES.items():
        v = virtual_stages if builder in LOOPED else 2 if builder not in ("gpipe", "1f1b") else 1
        costs = dict(forward=forward / v, backward=backward / v,
                     weight=None if weight is None else weight / v, comm=comm)
        for source in ("ours", "pytorch"):
            row = {"builder": builder, "source": source}
            try:
                schedule = (build(builder, ranks, microbatches, virtual_stages)
                            if source == "ours" else
                            pytorch_schedule(theirs, ranks, microbatches, v if v > 1 else None))
                validate(schedule)
            except Exception as exc:   # PyTorch refuses, or its order deadlocks
                rows.append({**row, "error": f"{type(exc).__name__}: {exc}".splitlines()[0]})
                continue
            rows.append({**row, **summary(schedule, simulate(schedule, **costs))})
    return rows

