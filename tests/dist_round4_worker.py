"""One rank of the two-process checks of issue 35 (`test_round4_distributed.py`), launched
once by torchrun on gloo. Each scenario records, per rank, what it computed (and what
PyTorch computes on the unpipelined model, where that is the answer) or the error it
raised, into ``DIR/rank<r>.pt``:

* ``ddp``: `sync.Pipe` inside `DistributedDataParallel` with ``static_graph=True`` and
  with ``find_unused_parameters=True`` (a parameter the forward never uses), at 1 and 3
  micro-batches, two steps; beside it DDP with the same flags over the plain model;
* ``clip``: a NaN (or inf) gradient on pipeline rank 1 only, clipped by the 2-norm and
  the inf-norm, with ``error_if_nonfinite`` and without;
* ``agree``: rank 1's target differs from rank 0's in one value; then its inputs, in a
  string flag;
* ``input``: the input's gradient from `DistributedPipe.step` on 2 stages (a SumCount
  loss, 1F1B) and on 2 replicas (a mean loss, ZB-H1's split backward);
* ``optimizer``: a checkpoint saved and resumed where the ranks built their optimizers
  differently (lr, weight decay, a group more on rank 1); a save refused on every rank
  when rank 1's optimizer holds a parameter outside the pipe, or a weight of rank 1 is NaN;
* ``one-rank-clip`` (last: its group times out): only rank 0 calls clip_grad_norm_.
"""
from __future__ import annotations

import argparse
import copy
import math
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from pipeline_lib import SumCount, run_state
from pipeline_lib.distributed import DistributedPipe
from pipeline_lib.distributed.job import process_group
from pipeline_lib.distributed.mesh import init_mesh
from pipeline_lib.grad_clip import clip_grad_norm_

ROWS, WIDTH, MICROBATCHES = 6, 4, 3


def linears(n: int = 4) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(n)])


def data(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(ROWS, WIDTH, generator=g), torch.randn(ROWS, WIDTH, generator=g)


def sum_count(out: torch.Tensor, target: torch.Tensor) -> SumCount:
    return SumCount(F.mse_loss(out, target, reduction="sum"), target.numel())


def error(call: Any) -> str | None:
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - recorded for the test to judge
        return f"{type(exc).__name__}: {exc}" + "".join(
            f" | {note}" for note in getattr(exc, "__notes__", []))
    return None


class Spare(nn.Linear):
    """A layer with a parameter its forward never uses."""

    def __init__(self) -> None:
        super().__init__(WIDTH, WIDTH)
        self.spare = nn.Parameter(torch.ones(2))


def ddp(rank: int) -> dict[str, Any]:
    from pipeline_lib.sync import Pipe
    found = {}
    for flag in ("static_graph", "find_unused_parameters"):
        for chunks in (1, 3):
            torch.manual_seed(0)
            layers = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), Spare())
            plain = copy.deepcopy(layers)
            pipe = DistributedDataParallel(Pipe(layers, chunks=chunks, checkpoint="never"),
                                           **{flag: True})
            reference = DistributedDataParallel(plain, **{flag: True})
            for step in range(2):
                x = data(10 * step + rank)[0]
                for model in (pipe, reference):
                    model.zero_grad()
                    out = model(x)
                    out = out.local_value() if model is pipe else out
                    out.square().mean().backward()
                found[f"{flag}-{chunks}-{step}"] = (
                    [p.grad.clone() for p in pipe.module.parameters() if p.grad is not None],
                    [p.grad.clone() for p in reference.module.parameters()
                     if p.grad is not None])
    return found


def clip(rank: int) -> dict[str, Any]:
    mesh = init_mesh(2, timeout=60)
    x, y = data()
    found = {}
    for bad in (math.nan, math.inf):
        for norm in (2.0, math.inf):
            pipe = DistributedPipe(linears(), mesh, [2, 2], MICROBATCHES)
            pipe.step(x, y, F.mse_loss)
            if rank == 1:
                next(pipe.parameters()).grad[0, 0] = bad
            before = [p.grad.clone() for p in pipe.parameters()]
            raised = error(lambda: clip_grad_norm_(pipe, 0.5, norm, error_if_nonfinite=True))
            kept = all(torch.allclose(p.grad, b, rtol=0, atol=0, equal_nan=True)
                       for p, b in zip(pipe.parameters(), before))
            total = clip_grad_norm_(pipe, 0.5, norm).item()
            # PyTorch on the unpipelined model, the same gradient broken
            plain = linears()
            F.mse_loss(plain(x), y).backward()
            plain[2].weight.grad[0, 0] = bad
            want_raised = error(lambda: torch.nn.utils.clip_grad_norm_(
                plain.parameters(), 0.5, norm, error_if_nonfinite=True))
            want = torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.5, norm).item()
            found[f"{bad}-{norm}"] = dict(raised=raised, kept=kept, total=total,
                                          want_raised=want_raised, want=want)
    return found


class First(nn.Module):
    """Takes ``(x, flag)`` and gives x."""

    def forward(self, batch: tuple[torch.Tensor, str]) -> torch.Tensor:
        return batch[0]


def agree(rank: int) -> dict[str, Any]:
    """Rank 1's target differs in one value; then its inputs in a string flag."""
    mesh = init_mesh(2, timeout=60)
    pipe = DistributedPipe(linears(), mesh, [2, 2], MICROBATCHES)
    x, y = data()
    other = y.clone()
    other[4, 1] += 1.0
    target = error(lambda: pipe.step(x, other if rank else y, F.mse_loss))
    pipe = DistributedPipe(nn.Sequential(First(), *linears(3)), mesh, [2, 2], MICROBATCHES)
    flag = error(lambda: pipe.step((x, "eval" if rank else "train"), y, F.mse_loss))
    return {"error": target, "flag": flag}


def input_grads(rank: int) -> dict[str, Any]:
    found = {}
    for name, (pp, dp, schedule, loss_fn) in {
            "2x1-1f1b-sumcount": (2, 1, "1f1b", sum_count),
            "1x2-zb_h1-mean": (1, 2, "zb_h1", F.mse_loss)}.items():
        mesh = init_mesh(pp, dp, timeout=60)
        pipe = DistributedPipe(linears(), mesh, [4 // pp] * pp, MICROBATCHES, schedule)
        x, y = data()
        x.requires_grad_()
        pipe.step(x, y, loss_fn)
        plain_x = x.detach().clone().requires_grad_()
        loss = loss_fn(linears()(plain_x), y)
        (loss.sum / loss.count if isinstance(loss, SumCount) else loss).backward()
        found[name] = dict(got=x.grad, want=plain_x.grad)
    return found


def _per_rank_optimizer(pipe: DistributedPipe, rank: int) -> torch.optim.Optimizer:
    """Rank 0: one group; rank 1: two, with their own lr and weight decay."""
    params = list(pipe.parameters())
    if rank == 0:
        return torch.optim.AdamW(params, lr=0.01, weight_decay=0.0)
    return torch.optim.AdamW([{"params": params[:2], "lr": 0.002, "weight_decay": 0.5},
                              {"params": params[2:], "lr": 0.003}], weight_decay=0.1)


def optimizer(rank: int, out: Path) -> dict[str, Any]:
    mesh = init_mesh(2, timeout=60)
    folder = out / "checkpoint"
    x, y = data()
    pipe = DistributedPipe(linears(), mesh, [2, 2], MICROBATCHES)
    opt = _per_rank_optimizer(pipe, rank)
    pipe.step(x, y, F.mse_loss)
    opt.step()
    run_state.save(folder, 1, pipe, [2, 2], opt)
    saved = [{k: v.clone() for k, v in opt.state[p].items()} for p in pipe.parameters()]

    fresh = DistributedPipe(linears(), mesh, [2, 2], MICROBATCHES)
    fresh_opt = _per_rank_optimizer(fresh, rank)
    resumed_at = run_state.resume(folder, fresh, [2, 2], fresh_opt)
    settings = [(g["lr"], g["weight_decay"]) for g in fresh_opt.param_groups]
    restored = all(torch.equal(fresh_opt.state[p][k], v) for p, state in
                   zip(fresh.parameters(), saved) for k, v in state.items())

    outside = nn.Parameter(torch.zeros(3))
    extra = torch.optim.AdamW([*pipe.parameters(), *([outside] if rank == 1 else [])])
    save_outside = error(lambda: run_state.save(folder, 2, pipe, [2, 2], extra))
    resume_outside = error(lambda: run_state.resume(folder, pipe, [2, 2], extra))
    if rank == 1:
        with torch.no_grad():
            next(pipe.parameters())[0, 0] = math.nan
    save_nan = error(lambda: run_state.save(folder, 3, pipe, [2, 2], opt))
    dist.barrier()
    return dict(resumed_at=resumed_at, settings=settings, restored=restored,
                save_outside=save_outside, resume_outside=resume_outside, save_nan=save_nan,
                latest=(folder / run_state.LATEST).read_text(),
                folders=sorted(p.name for p in folder.iterdir()))


def one_rank_clip(rank: int) -> dict[str, Any]:
    """Only rank 0 clips, on a mesh whose waits time out after 2 s (rank 1 waits at a
    barrier of the job's group for rank 0 to have given up)."""
    mesh = init_mesh(2, timeout=2)
    pipe = DistributedPipe(linears(), mesh, [2, 2], MICROBATCHES)
    pipe.step(*data(), F.mse_loss)
    raised = error(lambda: clip_grad_norm_(pipe, 0.5)) if rank == 0 else None
    dist.barrier()
    return {"error": raised}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with process_group(backend="gloo", timeout=60):
        rank = dist.get_rank()
        found = {"ddp": ddp(rank), "clip": clip(rank), "agree": agree(rank),
                 "input": input_grads(rank), "optimizer": optimizer(rank, args.out),
                 "one-rank-clip": one_rank_clip(rank)}
        torch.save(found, args.out / f"rank{os.environ['RANK']}.pt")


if __name__ == "__main__":
    main()
