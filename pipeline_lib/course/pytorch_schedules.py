"""PyTorch's own schedules as our `Schedule`, to validate, simulate and draw beside ours.

`torch.distributed.pipelining` (2.13) describes each schedule as a list of actions per
rank, written as we write them (``0F1``: stage 0, forward, micro-batch 1). Its schedule
visualiser (private: reached through `pipeline_lib.pytorch.private`) builds those lists
without starting processes; `pytorch_schedule` reads them with the one reader of PyTorch's
notation, `pipeline_lib.pytorch.notation`. Two things need translating:

* **placement**: ZBVZeroBubble and DualPipeV put stages in a V, which becomes the
  schedule's ``placement``;
* **overlapped pairs**: DualPipeV's ``(0F3;3B1)`` runs a forward and a backward of two
  chunks at once, to hide one's communication under the other's compute. Our executors
  run one action at a time, so a pair becomes its forward, then its backward; the pairs
  are kept in ``meta["overlapped"]``, as our own `dualpipe_v` keeps them.
"""
from __future__ import annotations

from pipeline_lib.pytorch import private
from pipeline_lib.pytorch.notation import from_pytorch
from pipeline_lib.schedules import LOOPED, Schedule, build, validate
from pipeline_lib.timeline import simulate, summary

# our builder's name -> PyTorch's schedule
PYTORCH_NAMES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved_1f1b": "Interleaved1F1B",
                 "looped_bfs": "LoopedBFS", "interleaved_zero_bubble": "InterleavedZeroBubble",
                 "zb_v": "ZBVZeroBubble", "dualpipe_v": "DualPipeV"}


def pytorch_schedule(name: str, ranks: int, microbatches: int,
                     virtual_stages: int | None = None) -> Schedule:
    """The order in which PyTorch's schedule ``name`` ("GPipe", "1F1B", "Interleaved1F1B",
    "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV") runs each rank's
    actions, as a `Schedule`. Not validated: call `validate` on it. PyTorch's own errors
    (a micro-batch count it does not support) pass through.

    Idle slots (None) and non-compute actions (REDUCE_GRAD) are dropped; overlapped pairs
    are split, forward first (see the module docstring).
    """
    return from_pytorch(private.schedule_ops(name, ranks, microbatches, virtual_stages),
                        f"PyTorch {name}", microbatches)


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

