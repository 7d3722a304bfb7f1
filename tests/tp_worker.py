"""The 4 gloo processes of `test_parallel_dist.py`: a ``tp × dp`` = 2 × 2 mesh (order
"tp-dp") running every case once, each rank saving what it computed to
``OUT/rank{r}.pt``; the test compares it with one process.

Cases (keys of the saved dict):

* ``("tp", sp, gather)``: the Transformer LM split by PyTorch's plans over each tp group,
  with and without sequence parallelism, logits gathered or loss-parallel: loss, and
  every gradient gathered whole;
* ``("block", sp)``: one block split by hand (`by_hand.split_block`) and by the plan,
  dropout off: each one's output and input gradient (this rank's positions under sp),
  and gathered weight gradients; and the messages of a forward and of a backward;
* ``("dropout", sp)``: the same block with dropout, both ways, and every dropout mask
  each rank drew, by shape;
* ``("fsdp", order, reshard)``: FSDP over each dp group driven through a pipeline
  stage's micro-batches in the order of a schedule (GPipe, 1F1B, ZB-H1's split
  backward), two steps: gradients gathered whole, and the second step's messages;
  ``("ddp",)``: the same with DDP;
* ``("2d", sp, data)``: tensor parallelism over tp and, over dp, FSDP or ``replicate``
  (DDP for DTensor weights) together, 1F1B, loss-parallel: gradients and the step's
  messages by dimension.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor.parallel import loss_parallel
from torch.nn.parallel import DistributedDataParallel

from pipeline_lib.course.workers.three_dimensions import (Masks, block_loss, gathered_grads,
                                                          run_stage, whole)
from pipeline_lib.distributed.job import process_group
from pipeline_lib.lm.loops import lm_loss
from pipeline_lib.lm.model import transformer_lm
from pipeline_lib.parallel.block import shardable
from pipeline_lib.parallel.by_hand import split_block
from pipeline_lib.parallel.fsdp import (reduce_gradients, replicate_stage, shard_stage,
                                        start_step)
from pipeline_lib.parallel.rank_order import device_mesh
from pipeline_lib.parallel.tensor_parallel import tensor_parallel
from pipeline_lib.parallel.traffic import Traffic
from pipeline_lib.rng import owned_rng

VOCAB, ROWS, SEQ, MICROBATCHES = 64, 8, 8, 4
ORDERS = {   # one stage's actions, in the order each schedule family runs them
    "gpipe": [("F", i) for i in range(4)] + [("B", i) for i in range(4)],
    "1f1b": [("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("F", 3), ("B", 2), ("B", 3)],
    "zb_h1": [("F", 0), ("F", 1), ("I", 0), ("F", 2), ("I", 1), ("W", 0), ("F", 3), ("I", 2),
              ("W", 1), ("I", 3), ("W", 2), ("W", 3)]}


def messages(traffic: Traffic) -> list[tuple[str, str, int, int]]:
    """(dimension, kind, bytes, ranks) of each message: plain values, which
    ``torch.load`` reads back with ``weights_only``."""
    return [(m.dim, m.kind, m.size, m.ranks) for m in traffic.messages]


def tiny_lm(dropout: float = 0.0) -> nn.Sequential:
    torch.manual_seed(0)
    return shardable(transformer_lm(VOCAB, d_model=16, nhead=4, d_hid=32, nlayers=2,
                                    dropout=dropout))


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return (torch.randint(0, VOCAB, (ROWS, SEQ), generator=g),
            torch.randint(0, VOCAB, (ROWS, SEQ), generator=g))


def block_input() -> torch.Tensor:
    return torch.randn(3, SEQ, 16, generator=torch.Generator().manual_seed(2))


def grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: whole(p.grad) for n, p in model.named_parameters()}


def tp_cases(mesh, results: dict) -> None:
    inputs, targets = batch()
    for sp in (False, True):
        for gather in (False, True):
            model = tensor_parallel(tiny_lm(), mesh["tp"], sp, gather_logits=gather)
            with contextlib.nullcontext() if gather else loss_parallel():
                loss = lm_loss(model(inputs), targets)
                loss.backward()
            results[("tp", sp, gather)] = dict(loss=whole(loss).item(), grads=grads(model))


def block_cases(mesh, results: dict) -> None:
    group, rank = mesh["tp"].get_group(), mesh["tp"].get_local_rank()
    for dropout, key in ((0.0, "block"), (0.3, "dropout")):
        block = tiny_lm(dropout)[1]
        for sp in (False, True):
            x = block_input()
            x = x.chunk(2, 1)[rank] if sp else x
            done = {}
            for way in ("hand", "plan"):
                split = (split_block(block, group, sp) if way == "hand" else
                         tensor_parallel(nn.Sequential(copy.deepcopy(block)), mesh["tp"], sp))
                given = x.clone().requires_grad_()
                with owned_rng(5), Masks() as masks, \
                        Traffic({"tp": group}) as forward:
                    out = split(given)
                with Traffic({"tp": group}) as backward:
                    block_loss(out).backward()
                done[way] = dict(out=out.detach().clone(), input_grad=given.grad.clone(),
                                 grads=gathered_grads(split, group) if way == "hand" else
                                 {n.split(".", 1)[1]: g for n, g in grads(split).items()},
                                 masks=masks.masks, forward=messages(forward),
                                 backward=messages(backward))
            results[(key, sp)] = done


def fsdp_cases(mesh, results: dict) -> None:
    dp, replica = mesh["dp"], mesh["dp"].get_local_rank()
    for order in ORDERS:
        for reshard in (True, False):
            model = shard_stage(tiny_lm(), dp, reshard_after_forward=reshard)
            for _ in range(2):   # the second step accumulates into the first's .grad
                with Traffic({"dp": dp.get_group()}) as traffic:
                    start_step([model], reshard and order != "zb_h1")
                    run_stage(model, ORDERS[order], batch(), MICROBATCHES, replica, 2)
                    reduce_gradients(model)
            results[("fsdp", order, reshard)] = dict(grads=grads(model),
                                                     messages=messages(traffic))
    model = DistributedDataParallel(tiny_lm(), process_group=dp.get_group(),
                                    broadcast_buffers=False)   # as DistributedPipe
    with Traffic({"dp": dp.get_group()}) as traffic, model.no_sync():
        # as DistributedPipe: the all-reduce armed for the last backward only
        run_stage(model, ORDERS["1f1b"], batch(), MICROBATCHES, replica, 2,
                  arm=lambda: model.reducer.prepare_for_backward([]))
    results[("ddp",)] = dict(grads={n.removeprefix("module."): g
                                    for n, g in grads(model).items()},
                             messages=messages(traffic))


def two_d_cases(mesh, results: dict) -> None:
    for sp in (False, True):
        for data in ("fsdp", "replicate"):
            model = tensor_parallel(tiny_lm(), mesh["tp"], sp)
            model = (shard_stage(model, mesh["dp"], reshard_after_forward=True)
                     if data == "fsdp" else replicate_stage(model, mesh["dp"]))
            with Traffic({"tp": mesh["tp"].get_group(),
                          "dp": mesh["dp"].get_group()}) as traffic, loss_parallel():
                start_step([model], True)
                run_stage(model, ORDERS["1f1b"], batch(), MICROBATCHES,
                          mesh["dp"].get_local_rank(), 2)
                reduce_gradients(model)
            results[("2d", sp, data)] = dict(grads=grads(model), messages=messages(traffic))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with process_group(timeout=120):
        mesh = device_mesh("cpu", "tp-dp", {"tp": 2, "dp": 2})
        results: dict = {}
        for cases in (tp_cases, block_cases, fsdp_cases, two_d_cases):
            cases(mesh, results)
        torch.save(results, args.out / f"rank{dist.get_rank()}.pt")


if __name__ == "__main__":
    main()
