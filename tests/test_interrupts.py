"""Ctrl-C in a notebook, at any point of a `Pipe` step: the step returns only once every
stage thread has stopped, ``.grad`` is as it was before the step (or, for an interrupt
during the final commit, holds the whole step), and the next step is exact."""
import signal
import threading
import time

import pytest
import torch
from torch import nn

from pipeline_lib import Pipe
from pipeline_lib.threaded import pipe as pipe_module
from conftest import assert_same_grads
from workloads import data


def interrupt_main() -> None:
    """What Ctrl-C does: a real SIGINT to the main thread, which wakes it from a wait."""
    signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)


class _SlowBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, layer):
        ctx.layer = layer
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.layer.on_backward()
        return grad, None


class SlowBackward(nn.Module):
    """Its backward takes ``seconds`` while armed; its weight's gradient is added only
    after that, so a backward left running adds it behind the caller's back."""

    def __init__(self, seconds: float):
        super().__init__()
        self.seconds, self.armed = seconds, True
        self.scale = nn.Parameter(torch.ones(()))
        self.started, self.finished = threading.Event(), threading.Event()

    def on_backward(self) -> None:
        if self.armed:
            self.started.set()
            time.sleep(self.seconds)
            self.finished.set()

    def forward(self, x):
        return _SlowBackward.apply(x * self.scale, self)


def slow_model(seconds: float = 1.5) -> nn.Sequential:
    """The slow backward on stage 0, the thread the caller waits for first. The
    interrupts below come 0.3 s into it: the rest is margin for a loaded machine."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 6), SlowBackward(seconds), nn.Tanh(), nn.Linear(6, 3))


def plain_grads(x, y) -> nn.Sequential:
    reference = slow_model()
    reference[1].armed = False
    nn.functional.cross_entropy(reference(x), y).backward()
    return reference


@pytest.mark.timeout(60)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb_h1"])
def test_ctrl_c_in_a_long_backward_waits_for_it_and_the_next_step_is_exact(schedule):
    """Issue 26 item 1: the interrupt used to return at once while the stage thread ran on
    and added its backward to the next step's gradients (CPython 3.11's
    ``Thread.is_alive()`` is False for a running thread whose ``join()`` was interrupted)."""
    x, y = data(4)
    model = slow_model()
    slow = model[1]
    pipe = Pipe(model, chunks=2, checkpoint="never", balance=[2, 2])

    def interrupt_mid_backward():
        if slow.started.wait(30):
            time.sleep(0.3)
            interrupt_main()

    interrupter = threading.Thread(target=interrupt_mid_backward)
    interrupter.start()
    with pytest.raises(KeyboardInterrupt):
        pipe.step(x, y, nn.CrossEntropyLoss(), schedule)
    interrupter.join()
    assert slow.finished.is_set(), "the step returned while a stage was still computing"
    assert all(p.grad is None for p in model.parameters()), "the step left gradients"

    slow.armed = False   # running the cell again
    pipe.step(x, y, nn.CrossEntropyLoss(), schedule)
    slow.finished.wait(5)   # (the old code's stray backward lands about now)
    assert_same_grads(model, plain_grads(x, y))


@pytest.mark.timeout(60)
def test_a_second_ctrl_c_while_a_stage_finishes_its_action_says_why_it_waits(capsys):
    x, y = data(4)
    model = slow_model(seconds=3.0)
    slow = model[1]
    pipe = Pipe(model, chunks=2, checkpoint="never", balance=[2, 2])

    def interrupt_twice():
        if slow.started.wait(30):
            for _ in range(2):
                time.sleep(0.3)
                interrupt_main()

    interrupter = threading.Thread(target=interrupt_twice)
    interrupter.start()
    with pytest.raises(KeyboardInterrupt):
        pipe.step(x, y, nn.CrossEntropyLoss(), "1f1b")
    interrupter.join()
    assert slow.finished.is_set()
    assert "Still waiting for the pipeline's threads" in capsys.readouterr().err
    assert all(p.grad is None for p in model.parameters())


# -- an interrupt at every point of a step -----------------------------------------------

class InterruptOnce(nn.Module):
    """Sends Ctrl-C to the main thread the first time its forward runs (``"forward"``)
    or its weight's gradient is computed (``"weight"``: in B, or in W under zb_h1), then
    keeps working a while, as a stage does that has not yet noticed."""

    def __init__(self, point: str):
        super().__init__()
        self.point, self.armed = point, True
        self.scale = nn.Parameter(torch.ones(()))
        self.scale.register_hook(self._on_weight_grad)

    def _fire(self, point: str) -> None:
        if self.armed and self.point == point:
            self.armed = False
            interrupt_main()
            time.sleep(0.1)

    def _on_weight_grad(self, grad):
        self._fire("weight")
        return grad

    def forward(self, x):
        self._fire("forward")
        return x * self.scale


def interrupting_model(point: str) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 6), nn.Tanh(), InterruptOnce(point), nn.Linear(6, 6),
                         nn.Tanh(), nn.Linear(6, 3))


class CommitInterrupted(pipe_module.StepGradients):
    """Ctrl-C as the step commits its gradients (the main thread signals itself)."""

    def commit(self, scale: float = 1.0) -> None:
        signal.raise_signal(signal.SIGINT)
        super().commit(scale)


class SetAsideInterrupted(pipe_module.StepGradients):
    """Ctrl-C just after ``.grad`` was set aside, before the stage threads start."""

    def __init__(self, parameters):
        super().__init__(parameters)
        signal.raise_signal(signal.SIGINT)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb_h1"])
@pytest.mark.parametrize("point", ["set aside", "forward", "loss", "weight", "commit"])
def test_an_interrupt_at_any_point_leaves_grads_whole_and_the_pipe_usable(
        point, schedule, monkeypatch):
    """Before the commit, ``.grad`` is as before the step; an interrupt during the commit
    is held until it is done, so the step counts whole. Either way the next step is
    exact. The old code lost the gradients set aside (``set aside``) or kept only this
    step's (``commit``)."""
    x, y = data(6)
    reference = interrupting_model(point)
    reference[2].armed = False
    nn.functional.cross_entropy(reference(x), y).backward()

    model = interrupting_model(point)
    before = [torch.full_like(p, 0.5) for p in model.parameters()]
    for p, g in zip(model.parameters(), before):
        p.grad = g.clone()
    pipe = Pipe(model, chunks=3, checkpoint="except_last", balance=[2, 2, 2])

    def loss_fn(out, target):
        if point == "loss" and model[2].armed:
            model[2].armed = False
            interrupt_main()
            time.sleep(0.1)
        return nn.functional.cross_entropy(out, target)

    if point == "commit":
        monkeypatch.setattr(pipe_module, "StepGradients", CommitInterrupted)
    if point == "set aside":
        monkeypatch.setattr(pipe_module, "StepGradients", SetAsideInterrupted)
    with pytest.raises(KeyboardInterrupt):
        pipe.step(x, y, loss_fn, schedule)
    monkeypatch.undo()
    time.sleep(0.2)   # a stage thread left running would change .grad meanwhile
    for p, g, q in zip(model.parameters(), before, reference.parameters()):
        expected = g + q.grad if point == "commit" else g
        torch.testing.assert_close(p.grad, expected, rtol=1e-5, atol=1e-6)

    model[2].armed = False
    model.zero_grad(set_to_none=True)
    pipe.step(x, y, loss_fn, schedule)
    assert_same_grads(model, reference)
