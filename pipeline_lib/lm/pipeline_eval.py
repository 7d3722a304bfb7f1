"""Evaluate the model a `DistributedPipe` holds, across its ranks, without a backward.

Evaluation has no backward to overlap with, so nothing is gained by pipelining it: each
batch runs stage after stage, every stage on its rank, the activation travelling whole,
from device to device (over NCCL between GPUs): a small header with its dtype and shape,
then the tensor itself, never a pickled copy through the CPU. Each replica takes its
rows of the batch; the loss is token-weighted as in `pipeline_lib.lm.loops.evaluate`:
summed over every target token of every batch, then divided by their count.
"""
from __future__ import annotations

import contextlib
import math
from typing import Any, ContextManager, Callable

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from pipeline_lib.devices import transfer
from pipeline_lib.distributed.pipe import DistributedPipe
from pipeline_lib.lm.data import get_batch
from pipeline_lib.lm.loops import batch_starts, lm_loss
from pipeline_lib.sharded import is_dtensor


DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
HEADER = 8   # dtype, number of dimensions, the shape


def _send(x: Any, dst: int) -> None:
    """Send an activation to global rank ``dst``: its header, then itself, both from the
    device it is on."""
    if not isinstance(x, Tensor) or x.dtype not in DTYPES or x.dim() > HEADER - 2:
        raise TypeError(f"evaluate_pipeline sends one floating-point tensor of at most "
                        f"{HEADER - 2} dimensions between stages, got {type(x).__name__} "
                        f"{getattr(x, 'dtype', '')} {list(getattr(x, 'shape', []))}")
    fields = [DTYPES.index(x.dtype), x.dim(), *x.shape]
    header = torch.tensor(fields + [0] * (HEADER - len(fields)), dtype=torch.int64)
    dist.send(header.to(x.device), dst)
    dist.send(x.contiguous(), dst)


def _receive(src: int, device: torch.device) -> Tensor:
    """What `_send` sent from global rank ``src``, received on ``device``."""
    header = torch.empty(HEADER, dtype=torch.int64, device=device)
    dist.recv(header, src)
    dtype, ndim, *shape = header.tolist()   # evaluation is rare: this read costs nothing
    x = torch.empty(shape[:ndim], dtype=DTYPES[dtype], device=device)
    dist.recv(x, src)
    return x


def _forward_stages(pipe: DistributedPipe, stages: dict[int, nn.Module], inputs: Tensor) -> Any:
    """Run this rank's stages of one batch in stage order, receiving each stage's input
    from the rank before it and sending its output on; the last stage's output on its
    rank, None elsewhere."""
    mesh, schedule = pipe.mesh, pipe.schedule
    mine = [s for s in range(schedule.stages) if s in stages]
    x: Any = inputs
    for s in mine:
        if s > 0 and s - 1 not in stages:
            x = _receive(mesh.global_rank(schedule.rank_of(s - 1)), mesh.device)
        x = stages[s](transfer(x, mesh.device))
        if s < schedule.stages - 1 and s + 1 not in stages:
            _send(x, mesh.global_rank(schedule.rank_of(s + 1)))
    return x if schedule.stages - 1 in stages else None


@torch.no_grad()
def evaluate_pipeline(pipe: DistributedPipe, source: Tensor, bptt: int, *,
                      max_steps: int | None = None,
                      precision: Callable[[], ContextManager[Any]] = contextlib.nullcontext,
                      ) -> tuple[float, float]:
    """Mean next-token loss over every target token of ``source`` (``[B, N]`` from
    ``batchify``, the same on every rank) and its perplexity, on every rank; every rank
    must call it. ``precision`` makes the context each forward runs in (an autocast)."""
    mesh = pipe.mesh
    stages = {s: m.module if isinstance(m, DistributedDataParallel) else m
              for s, m in pipe.modules.items()}
    modes = {s: m.training for s, m in stages.items()}
    for m in stages.values():
        m.eval()
    totals = torch.zeros(2, dtype=torch.float64, device=mesh.device)  # [loss sum, tokens]
    try:
        for i in batch_starts(source, bptt, max_steps):
            inputs, targets = get_batch(source, i, bptt)
            rows = torch.tensor_split(torch.arange(inputs.size(0)), mesh.dp)[mesh.replica]
            # logits split over the vocabulary (tp > 1) take loss_parallel's cross-entropy;
            # each tp rank then adds the same sum and count: the mean is unchanged
            with precision(), _vocabulary_parallel(mesh.tp):
                logits = _forward_stages(pipe, stages, inputs[rows])
                if logits is not None:
                    mine = targets[rows].to(mesh.device)
                    loss = lm_loss(logits, mine, reduction="sum")
                    totals[0] += (loss.to_local() if is_dtensor(loss) else loss).double()
                    totals[1] += mine.numel()
    finally:
        for s, m in stages.items():
            m.train(modes[s])
    dist.all_reduce(totals)   # only the replicas' last-stage ranks added anything
    mean = (totals[0] / totals[1]).item()
    return mean, math.exp(mean)


def _vocabulary_parallel(tp: int) -> ContextManager[None]:
    """PyTorch's ``loss_parallel`` where the logits are split over the vocabulary
    (imported only then: see `pipeline_lib.sharded`)."""
    if tp == 1:
        return contextlib.nullcontext()
    from torch.distributed.tensor.parallel import loss_parallel
    return loss_parallel()
