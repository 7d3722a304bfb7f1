"""The gradient of the step's inputs: an input that requires grad gets, from ``step``, the
``.grad`` that ``loss.backward()`` gives it on the unpipelined model, on every schedule
(full and split backward, looped and V), checkpoint mode, executor and loss (a mean or a
`SumCount`). The step computes it on the first stage like any stage's input gradient,
and once the step knows the loss's scale, backpropagates it into the caller's graph: what
the input was computed from (a layer outside the pipe) gets its gradient too.

`DistributedPipe` runs in this process on a one-rank mesh (both stages of a V on it);
`test_round4.py` runs it on two processes (the input on another rank than the loss, and
on two replicas).
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pipeline_lib import NoChunk, Pipe, SumCount
from pipeline_lib.schedules import BUILDERS, build, stages_per_rank

MICROBATCHES = 4


def model(layers: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(layers)])


def sum_count(out: torch.Tensor, target: torch.Tensor) -> SumCount:
    return SumCount(F.mse_loss(out, target, reduction="sum"), target.numel())


LOSSES = {"mean": F.mse_loss, "sumcount": sum_count}


def batch_loss(loss_fn, out, target) -> torch.Tensor:
    loss = loss_fn(out, target)
    return loss.sum / loss.count if isinstance(loss, SumCount) else loss


def plain_grads(layers: int, loss_fn, x: torch.Tensor, y: torch.Tensor):
    """x.grad and the weights' gradients of the unpipelined model."""
    plain, x = model(layers), x.detach().clone().requires_grad_()
    batch_loss(loss_fn, plain(x), y).backward()
    return x.grad, [p.grad for p in plain.parameters()]


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(10, 4, generator=g), torch.randn(10, 4, generator=g)


@pytest.mark.parametrize("checkpoint, loss", [("never", "mean"), ("always", "sumcount"),
                                              ("except_last", "sumcount")])
@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_pipe_step_gives_the_input_its_gradient(name, checkpoint, loss):
    """It was 8x (the count) too large with SumCount, and None under split backwards."""
    stages = 2 * stages_per_rank(name)
    x, y = data()
    want_x, want = plain_grads(stages, LOSSES[loss], x, y)
    pipe = Pipe(model(stages), MICROBATCHES, checkpoint, [1] * stages)
    x.requires_grad_()
    pipe.step(x, y, LOSSES[loss], build(name, 2, MICROBATCHES))
    torch.testing.assert_close(x.grad, want_x)
    for p, q in zip(pipe.parameters(), want):
        torch.testing.assert_close(p.grad, q)


@pytest.mark.parametrize("schedule", ["1f1b", "zb_h1"])
def test_the_gradient_reaches_what_the_input_was_computed_from(schedule):
    """A layer outside the pipe (an embedding of one's own, say): its weight gets the
    batch loss's gradient; a gradient already in x.grad or there is added to."""
    torch.manual_seed(2)
    before = nn.Linear(4, 4)
    plain_before = copy.deepcopy(before)
    x, y = data()
    plain_x = x.clone().requires_grad_()
    batch_loss(sum_count, model(2)(plain_before(plain_x)), y).backward()
    leaf = x.clone().requires_grad_()
    leaf.grad = torch.ones_like(leaf)
    before.weight.grad = torch.ones_like(before.weight)
    Pipe(model(2), MICROBATCHES, "never", [1, 1]).step(before(leaf), y, sum_count, schedule)
    torch.testing.assert_close(leaf.grad, plain_x.grad + 1)
    torch.testing.assert_close(before.weight.grad, plain_before.weight.grad + 1)


class Scaled(nn.Module):
    """Takes ``{"x": rows, "scale": a tensor for every row, "mask": rows}``."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.linear(batch["x"]) * batch["scale"] * batch["mask"]


def test_every_input_tensor_that_requires_grad_gets_it_nochunk_included():
    """A tree of inputs: the rows' tensor and a NoChunk tensor shared by every micro-batch
    (its gradient is the sum of the micro-batches'); a tensor not requiring grad gets
    none."""
    x, y = data()
    scale = torch.full((4,), 1.5)
    torch.manual_seed(3)
    layers = nn.Sequential(Scaled(), nn.Tanh(), nn.Linear(4, 4))
    plain = copy.deepcopy(layers)
    mask = torch.ones(10, 4)
    want = [t.clone().requires_grad_() for t in (x, scale)]
    F.mse_loss(plain({"x": want[0], "scale": want[1], "mask": mask}), y).backward()
    got = [t.clone().requires_grad_() for t in (x, scale)]
    frozen = mask.clone()
    Pipe(layers, MICROBATCHES, balance=[1, 2]).step(
        {"x": got[0], "scale": NoChunk(got[1]), "mask": frozen}, y, F.mse_loss, "zb_h1")
    for g, w in zip(got, want):
        torch.testing.assert_close(g.grad, w.grad)
    assert frozen.grad is None


@pytest.mark.parametrize("loss", sorted(LOSSES))
@pytest.mark.parametrize("name", ["1f1b", "zb_h1", "interleaved_1f1b", "zb_v", "dualpipe_v"])
def test_distributed_pipe_step_gives_the_input_its_gradient(one_rank_mesh, name, loss):
    from pipeline_lib.distributed import DistributedPipe
    stages = stages_per_rank(name)
    x, y = data()
    want_x, want = plain_grads(stages, LOSSES[loss], x, y)
    pipe = DistributedPipe(model(stages), one_rank_mesh, [1] * stages, MICROBATCHES, name)
    x.requires_grad_()
    pipe.step(x, y, LOSSES[loss])
    torch.testing.assert_close(x.grad, want_x)
    for p, q in zip(pipe.parameters(), want):
        torch.testing.assert_close(p.grad, q)
