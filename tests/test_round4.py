"""Issue 35: no silent wrong answer, round 3 of the hostile user's findings, each checked
against what PyTorch computes on the unpipelined model where there is a value, and each
error for naming what was wrong and the fix. Input gradients have their own file
(`test_input_grads.py`); the checks that need two processes run in one torchrun launch
(`dist_round4_worker.py`, the ``two_ranks`` fixture)."""
from __future__ import annotations

import copy
import threading
import time

import torch
import torch.nn.functional as F
from torch import nn

from pipeline_lib import Pipe, SumCount


def sum_count(out: torch.Tensor, target: torch.Tensor) -> SumCount:
    return SumCount(F.mse_loss(out, target, reduction="sum"), target.numel())


# -- 7. pipe(x) from another thread during a step --------------------------------------

def test_a_backward_of_pipe_x_during_a_sum_count_step_is_not_scaled_by_its_count():
    """pipe(x)'s backward, run from another thread while a SumCount step ran, added into
    the .grad the step had set aside, and the step divided it by its count (32): the
    weights got 1/32 of that gradient. Now it waits for the step: exact, however the
    threads are timed (here the step's loss takes its time, once the other has begun)."""
    torch.manual_seed(0)
    layers = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    plain = copy.deepcopy(layers)
    x, y, other = torch.randn(8, 4), torch.randn(8, 4), torch.randn(8, 4)
    (F.mse_loss(plain(x), y) + plain(other).sum()).backward()
    pipe = Pipe(layers, chunks=4, balance=[2, 1], checkpoint="never")
    started = threading.Event()

    def slow_loss(out: torch.Tensor, target: torch.Tensor) -> SumCount:
        started.set()
        time.sleep(0.05)
        return sum_count(out, target)

    def elsewhere() -> None:
        started.wait(10)
        pipe(other).sum().backward()

    thread = threading.Thread(target=elsewhere)
    thread.start()
    pipe.step(x, y, slow_loss)
    thread.join()
    for p, q in zip(pipe.parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
