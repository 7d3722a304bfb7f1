"""Checks of notebook 03b's exercises (the classic API's skip connections and BatchNorm).

3b.1 runs the learner's two skippable layers in a classic `Pipe` whose every layer is a
stage of its own, so the stashed tensor has to cross stages, with a layer *before* the
stash: a stash that detaches its tensor, or passes it some other way than ``stash`` /
``pop``, leaves that layer's gradient or the output wrong. 3b.2 compares predicted running
means with those the notebook's classic `Pipe` (`pipeline_lib.sync.Pipe`, which splits a
batch as ``torch.chunk`` does) leaves, measured before the learner's call: on batches it
splits unevenly (11 rows in 4 micro-batches: 3, 3, 3, 2), so that weighing micro-batches
equally gives another number; on 14 rows in 4 (4, 4, 4, 2), where the core `Pipe`'s
`pipeline_lib.microbatch.split` would make 4, 4, 3, 3, so that an answer that splits the
other way fails on every run; and on batches of sizes drawn for every run (no message
prints the running means the pipeline leaves). Both `Pipe`s and both
`DeferredBatchNorm`s (the classic API's is a subclass, a class of its own) are refused
during the learner's call, however reached: running them is what the prediction must do
without. A plain ``nn.BatchNorm1d`` is not: feeding it the rows each update sees is the
prediction.
"""
from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from pipeline_lib.batchnorm import DeferredBatchNorm
from pipeline_lib.course.exercises import (ExerciseFailed, hidden_cases, ignores_namespace,
                                           withheld)
from pipeline_lib.skip import Skippable
from pipeline_lib.sync import Pipe as ClassicPipe
from pipeline_lib.sync.batchnorm import DeferredBatchNorm as ClassicDeferredBatchNorm
from pipeline_lib.threaded import Pipe

__all__ = ["check_skip_pair", "running_means_after_a_step", "check_running_means"]

WIDTH = 8


class _Residual(nn.Module):
    """The unpipelined reference: ``after(x) + x`` around a block, with the same layers."""

    def __init__(self, before: nn.Module, block: nn.Sequential):
        super().__init__()
        self.before, self.block = before, block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.before(x)
        return self.block(h) + h


def check_skip_pair(stash_input: Callable[[nn.Module], nn.Module],
                    add_stashed: Callable[[], nn.Module]) -> None:
    """Exercise 3b.1: ``stash_input(inner)`` stashes its input as "skip" and returns
    ``inner(x)``; ``add_stashed()`` pops "skip" and adds it to its input. In a classic
    `Pipe` of 5 one-layer stages, ``Linear, stash_input(Linear), Tanh, Linear,
    add_stashed()`` must give the residual block's output and gradients."""
    torch.manual_seed(0)
    before, inner, last = (nn.Linear(WIDTH, WIDTH) for _ in range(3))
    start, end = stash_input(inner), add_stashed()
    for layer, verb, declared, role in [(start, "stash", "stashes", "stash_input"),
                                        (end, "pop", "pops", "add_stashed")]:
        if not isinstance(layer, Skippable) or "skip" not in getattr(layer, declared):
            raise ExerciseFailed(
                f"{role}'s layer {type(layer).__name__} does not declare {verb}=['skip']: a "
                f"tensor that skips layers must travel by stash and pop, which the pipeline "
                f"carries from stage to stage (decorate the class with "
                f"@skippable({verb}=['skip']))")
    layers = [before, start, nn.Tanh(), last, end]
    reference = _Residual(copy.deepcopy(before), copy.deepcopy(nn.Sequential(inner, nn.Tanh(),
                                                                              last)))
    (rows, chunks), = hidden_cases(lambda rng: (rows := rng.randint(5, 16),
                                                rng.randint(2, min(rows, 6))), 1)
    pipe = ClassicPipe(nn.Sequential(*layers), chunks=chunks)
    x = torch.randn(rows, WIDTH)
    output = pipe(x).local_value()
    expected = reference(x)
    if not torch.allclose(output, expected, atol=1e-5):
        raise ExerciseFailed(
            f"the pipeline's output is not the residual block's, block(h) + h, where h is "
            f"stash_input's input (largest difference {(output - expected).abs().max():.3g}). "
            f"Stash the input itself, return inner(input), and add the popped tensor to "
            f"add_stashed's input")
    output.square().mean().backward()
    expected.square().mean().backward()
    names = ["before.weight", "before.bias", "inner.weight", "inner.bias", "last.weight",
             "last.bias"]
    mine = [before.weight, before.bias, inner.weight, inner.bias, last.weight, last.bias]
    theirs = [reference.before.weight, reference.before.bias, reference.block[0].weight,
              reference.block[0].bias, reference.block[2].weight, reference.block[2].bias]
    for name, a, b in zip(names, mine, theirs):
        if a.grad is None or not torch.allclose(a.grad, b.grad, atol=1e-5):
            raise ExerciseFailed(
                f"the output is right, but {name}'s gradient is not the residual block's: "
                f"the stashed tensor must stay connected to autograd (no .detach(), no "
                f"copy out of the graph), so that the skip's gradient reaches the layers "
                f"before it")


def running_means_after_a_step(x: torch.Tensor, chunks: int, momentum: float,
                               deferred: bool) -> torch.Tensor:
    """The running mean a ``BatchNorm1d`` (fresh: running mean 0) holds after one training
    step of the notebook's classic `Pipe` over ``x`` in ``chunks`` micro-batches (as
    ``x.chunk(chunks)`` cuts it), checkpointing every one."""
    pipe = ClassicPipe(nn.Sequential(nn.BatchNorm1d(x.size(1), momentum=momentum),
                                     nn.Identity()),
                       chunks=chunks, checkpoint="always", deferred_batch_norm=deferred)
    pipe(x).local_value().sum().backward()
    norm = next(m for m in pipe.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm))
    return norm.running_mean.clone()


def _batch(rng: Any) -> tuple[int, int, int, float]:
    """Rows, features, chunks and momentum of a batch drawn for this run: every
    micro-batch ``torch.chunk`` makes has 2 rows or more (BatchNorm's training forward
    needs them)."""
    while True:
        rows = rng.randint(5, 20)
        chunks = rng.randint(2, min(rows // 2, 6))
        if min(len(c) for c in torch.empty(rows).chunk(chunks)) >= 2:
            return rows, rng.randint(1, 4), chunks, rng.choice([0.1, 0.2, 0.5])


@ignores_namespace(1)
def check_running_means(predict: Callable[[torch.Tensor, int, float], Any]) -> None:
    """Exercise 3b.2: ``predict(x, chunks, momentum)`` returns ``(plain, deferred)``, the
    running means after one step of the classic `Pipe` with plain BatchNorm and with
    `DeferredBatchNorm`, on the notebook's three batches (14 rows in 4, where
    ``x.chunk`` and `pipeline_lib.microbatch.split` cut differently, among them) and on
    batches of sizes drawn for this run."""
    torch.manual_seed(0)
    cases = [(torch.randn(11, 3) * 2 + torch.tensor([1.0, -3.0, 0.5]), 4, 0.1),
             (torch.randn(8, 2) + 4, 3, 0.3),
             (torch.randn(14, 2) * 3 - 1, 4, 0.2)]
    cases += [(torch.randn(rows, features) * 3 + 1, chunks, momentum)
              for rows, features, chunks, momentum in hidden_cases(_batch, 2)]
    expected = [(running_means_after_a_step(x, m, p, False),
                 running_means_after_a_step(x, m, p, True)) for x, m, p in cases]
    for (x, chunks, momentum), (plain, deferred) in zip(cases, expected):
        sizes = [len(c) for c in x.chunk(chunks)]
        case = f"{len(x)} rows in micro-batches of {sizes}, momentum {momentum}"
        with withheld(Pipe, ClassicPipe, DeferredBatchNorm, ClassicDeferredBatchNorm):
            answer = predict(x.clone(), chunks, momentum)
        if not (isinstance(answer, tuple) and len(answer) == 2
                and all(isinstance(a, torch.Tensor) for a in answer)):
            raise ExerciseFailed(f"return a pair of tensors (plain, deferred), one running "
                                 f"mean per feature each; got {answer!r}")
        for name, mine, right, how in [
                ("plain BatchNorm", answer[0], plain,
                 "it updates its running statistics after every micro-batch, in order, "
                 "each update with that micro-batch's own mean, and a checkpoint's replay "
                 "does not update them again"),
                ("DeferredBatchNorm", answer[1], deferred,
                 "it updates them once per step, with the statistics of all the step's "
                 "rows together, as the model without a pipeline would")]:
            if mine.shape != right.shape or not torch.allclose(mine.float(), right, atol=1e-5):
                raise ExerciseFailed(f"{case}: your running mean for {name} is "
                                     f"{mine.tolist()}, not the one the pipeline leaves; "
                                     f"{how}")
