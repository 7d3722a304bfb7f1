"""Notebook 03b's exercise checks, in-process: the solution passes, and plausible wrong
answers and the library shortcut each fail with the exercise's own message."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from pipeline_lib import Pipe
from pipeline_lib.course.checks import nb03b
from pipeline_lib.course.exercises import exercise
from pipeline_lib.microbatch import split
from pipeline_lib.sync.skip import pop, skippable, stash
from conftest import fails

EX1 = "Exercise 3b.1 (a skip connection across stages)"
EX2 = "Exercise 3b.2 (running means after a step)"



# --------------------------------------------------------------------- 3b.1

def start_class(stashed=lambda x, y: x):
    @skippable(stash=["skip"])
    class StashInput(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            y = self.inner(x)
            yield stash("skip", stashed(x, y))
            return y
    return StashInput


def end_class(added=lambda x, skip: x + skip):
    @skippable(pop=["skip"])
    class AddStashed(nn.Module):
        def forward(self, x):
            skip = yield pop("skip")
            return added(x, skip)
    return AddStashed


class AttributeStart(nn.Module):
    """Passes the input on a class attribute instead of stash/pop."""
    last: torch.Tensor | None = None

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        AttributeStart.last = x
        return self.inner(x)


class AttributeEnd(nn.Module):
    def forward(self, x):
        return x + AttributeStart.last


def test_3b_1_solution_passes(capsys):
    with exercise(EX1):
        nb03b.check_skip_pair(start_class(), end_class())
    assert f"{EX1}: passed" in capsys.readouterr().out


@pytest.mark.parametrize("start, end, says", [
    (start_class(), end_class(lambda x, skip: x), "residual block's, block(h) + h"),
    (start_class(lambda x, y: y), end_class(), "residual block's, block(h) + h"),
    (start_class(lambda x, y: x.detach()), end_class(), "before.weight's gradient"),
    (start_class(), end_class(lambda x, skip: x + skip.detach()), "before.weight's gradient"),
    (start_class(), end_class(lambda x, skip: x - skip), "residual block's, block(h) + h"),
    (AttributeStart, AttributeEnd, "does not declare stash=['skip']"),
    (start_class(), AttributeEnd, "does not declare pop=['skip']"),
])
def test_3b_1_wrong_answers_fail(start, end, says):
    assert says in fails(EX1, lambda: nb03b.check_skip_pair(start, end))


def test_3b_1_more_wrong_answers_fail():
    fails(EX1, lambda: nb03b.check_skip_pair(start_class(lambda x, y: x.clone().detach()),
                                             end_class()), says="gradient")
    fails(EX1, lambda: nb03b.check_skip_pair(start_class(lambda x, y: 2 * x), end_class()),
          says="residual block's")
    fails(EX1, lambda: nb03b.check_skip_pair(start_class(),
                                             end_class(lambda x, skip: x * skip)),
          says="residual block's")


def test_3b_1_mismatched_names_fail():
    @skippable(pop=["shortcut"])
    class PopsAnotherName(nn.Module):
        def forward(self, x):
            return x + (yield pop("shortcut"))
    fails(EX1, lambda: nb03b.check_skip_pair(start_class(), PopsAnotherName))


# --------------------------------------------------------------------- 3b.2

def solution(x, chunks, momentum, cut=lambda t, k: t.chunk(k)):
    plain = torch.zeros(x.size(1))
    for micro in cut(x, chunks):
        plain = (1 - momentum) * plain + momentum * micro.mean(0)
    return plain, momentum * x.mean(0)


def with_split(x, chunks, momentum):          # the core Pipe's cut: 14 rows in 4 -> 4, 4, 3, 3
    return solution(x, chunks, momentum, cut=split)


def test_3b_2_micro_batches_cut_as_the_core_pipe_cuts_fail():
    """The classic Pipe cuts as torch.chunk does; the shown 14 rows in 4 are where
    pipeline_lib.microbatch.split differs, so the other cut fails on every run."""
    assert [len(c) for c in split(torch.zeros(14), 4)] != [len(c) for c in
                                                             torch.zeros(14).chunk(4)]
    fails(EX2, lambda: nb03b.check_running_means(with_split), says="plain BatchNorm")


def chunk_by_hand(x, chunks, momentum):       # right, written otherwise: ceil(rows / chunks)
    size, plain = -(-len(x) // chunks), torch.zeros(x.size(1))
    for start in range(0, len(x), size):
        plain = plain + momentum * (x[start:start + size].mean(0) - plain)
    return plain, x.sum(0) / len(x) * momentum


def test_3b_2_right_answer_written_another_way_passes(capsys):
    with exercise(EX2):
        nb03b.check_running_means(chunk_by_hand)
    assert f"{EX2}: passed" in capsys.readouterr().out


def plain_table(x, chunks, momentum):         # right on the notebook's three batches only
    assert (len(x), x.size(1), chunks, momentum) in {(11, 3, 4, 0.1), (8, 2, 3, 0.3),
                                                       (14, 2, 4, 0.2)}, \
        "only the shown batches"
    return solution(x, chunks, momentum)


def no_microbatches(x, chunks, momentum):
    return momentum * x.mean(0), momentum * x.mean(0)


def micro_means_weighted_equally(x, chunks, momentum):
    plain, _ = solution(x, chunks, momentum)
    return plain, momentum * torch.stack([c.mean(0) for c in x.chunk(chunks)]).mean(0)


def no_decay(x, chunks, momentum):
    return sum(momentum * c.mean(0) for c in x.chunk(chunks)), momentum * x.mean(0)


def replay_counted_twice(x, chunks, momentum):
    plain = torch.zeros(x.size(1))
    for micro in x.chunk(chunks):
        for _ in range(2):                   # forward, then the checkpoint's replay
            plain = (1 - momentum) * plain + momentum * micro.mean(0)
    return plain, momentum * x.mean(0)


def deferred_like_plain(x, chunks, momentum):
    plain, _ = solution(x, chunks, momentum)
    return plain, plain


def shortcut(x, chunks, momentum):
    return tuple(nb03b.running_means_after_a_step(x, chunks, momentum, deferred)
                 for deferred in (False, True))


def shortcut_pipe(x, chunks, momentum):
    pipe = Pipe(nn.Sequential(nn.BatchNorm1d(x.size(1), momentum=momentum), nn.Identity()),
                chunks, balance=[1, 1], devices=["cpu", "cpu"], deferred_batch_norm=True)
    pipe.step(x, torch.zeros(len(x)), lambda out, _: out.sum())
    return solution(x, chunks, momentum)[0], pipe.partitions[0][0].running_mean


def test_3b_2_solution_passes(capsys):
    with exercise(EX2):
        nb03b.check_running_means(solution)
    assert f"{EX2}: passed" in capsys.readouterr().out


@pytest.mark.parametrize("wrong, says", [
    (no_microbatches, "plain BatchNorm"), (no_decay, "plain BatchNorm"),
    (replay_counted_twice, "plain BatchNorm"),
    (micro_means_weighted_equally, "DeferredBatchNorm"),
    (deferred_like_plain, "DeferredBatchNorm"),
    (lambda x, chunks, momentum: solution(x, chunks, momentum)[0], "a pair of tensors"),
    (plain_table, "only the shown batches"),
    (lambda x, chunks, momentum: (solution(x, chunks, momentum)[0],
                                  x.mean(0)), "DeferredBatchNorm"),       # momentum forgotten
    (lambda x, chunks, momentum: (solution(x, chunks, 1 - momentum)[0],
                                  momentum * x.mean(0)), "plain BatchNorm")])   # the other way
def test_3b_2_wrong_answers_fail(wrong, says):
    assert says in fails(EX2, lambda: nb03b.check_running_means(wrong))


def shortcut_classic_deferred(x, chunks, momentum):
    """The classic API's DeferredBatchNorm, a subclass of pipeline_lib's: a class of its own."""
    from pipeline_lib.sync.batchnorm import DeferredBatchNorm
    norm = DeferredBatchNorm(x.size(1), momentum=momentum, chunks=chunks)
    for micro in x.chunk(chunks):
        norm(micro)
    return solution(x, chunks, momentum)[0], norm.running_mean.clone()


@pytest.mark.parametrize("answer", [shortcut, shortcut_pipe, shortcut_classic_deferred])
def test_3b_2_shortcuts_fail(answer):
    assert "which computes the very answer" in fails(
        EX2, lambda: nb03b.check_running_means(answer))
