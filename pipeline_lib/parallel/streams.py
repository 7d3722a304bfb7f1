"""Dropout under tensor parallelism: the same mask where the ranks hold the same tensor,
different masks where each holds a different part of it.

The t ranks of a tensor-parallel group run one stage's micro-batch together, so each
draws from the same random stream (`pipeline_lib.rng`: seeded by step, stage and
micro-batch; the tensor-parallel rank is not part of it). That is right for a tensor
every rank holds whole (the hidden state after a row-parallel layer's all-reduce, whose
dropout must agree or the ranks' copies drift apart), and wrong for one each rank holds
a different part of (its heads' attention probabilities, its columns of the MLP, its
slice of the sequence under sequence parallelism): drawn from one stream, rank 1's heads
would get rank 0's heads' masks. Megatron-LM keeps two generators for this (its
"model-parallel" RNG tracker, forked for sharded regions).

Here a sharded region draws one seed from the shared stream, which every rank does
alike, and runs on a stream of its own seeded by that number and the rank. So the
shared stream goes on identically on every rank, the region's masks differ between
ranks, and both replay exactly when the stage recomputes its forward (activation
checkpointing replays the shared stream, hence the drawn seed). With one rank nothing is
forked: a layer split over one rank draws what the unsplit layer draws.

What this needs from `pipeline_lib.rng`: `microbatch_rng(seed, device)` entered inside
another stream (the innermost stream serves the block's random kernels) and `seed_for`.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from pipeline_lib.rng import microbatch_rng, seed_for

SHARDED = -2   # seed_for's "stage" slot for a sharded region: no stage is negative but -1,
#                which the executor uses for replicas


@contextlib.contextmanager
def sharded_stream(rank: int, ranks: int, device: torch.device | str = "cpu") -> Iterator[None]:
    """Run the block on a random stream of tensor-parallel rank ``rank`` of ``ranks``
    (see the module docstring); with ``ranks`` = 1, on the stream already running."""
    if ranks == 1:
        yield
        return
    drawn = int(torch.randint(0, 2 ** 62, ()).item())   # the same on every rank
    with microbatch_rng(seed_for(drawn, SHARDED, rank), device):
        yield
