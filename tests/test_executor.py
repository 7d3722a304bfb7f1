"""The executor loop's hot path: a one-rank step pays for nothing it does not need, with
the same dropout masks; actions on CUDA are timed without a host sync per action."""
import threading

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode

from pipeline_lib import Pipe
from pipeline_lib.executor import Stopwatch
from pipeline_lib.microbatch import loss_weights, split
from pipeline_lib.rng import microbatch_rng, new_step_seed, seed_for
from pipeline_lib.schedules import Action
from conftest import assert_same_grads
from workloads import CHECKPOINTS, data, make_model


class Watch(nn.Module):
    """Records, at each forward, the thread it runs on and the dispatch mode around it."""

    def __init__(self):
        super().__init__()
        self.seen: list[tuple[bool, object]] = []

    def forward(self, x):
        self.seen.append((threading.current_thread() is threading.main_thread(),
                          _get_current_dispatch_mode()))
        return x


@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb_h1"])
def test_a_one_stage_step_draws_the_masks_of_its_streams_on_the_callers_thread(
        schedule, checkpoint):
    """One stage, so one thread draws: no dispatch mode sees every kernel, no thread is
    started, and each micro-batch's dropout masks are still those of its own stream
    (`microbatch_rng` seeded for (step, stage 0, micro-batch)), replayed exactly by a
    checkpointed micro-batch. The old code ran every forward under the dispatch mode, on
    a stage thread."""
    x, y = data()
    loss_fn = nn.CrossEntropyLoss()
    reference = make_model(dropout=0.5)
    torch.manual_seed(7)
    step_seed = new_step_seed()
    micro_x, micro_y = split(x, 3), split(y, 3)
    for i, (w, xi, yi) in enumerate(zip(loss_weights(micro_y), micro_x, micro_y)):
        with microbatch_rng(seed_for(step_seed, 0, i)):
            (loss_fn(reference(xi), yi) * w).backward()

    model = make_model(dropout=0.5)
    watch = Watch()
    pipe = Pipe(nn.Sequential(watch, *model), chunks=3, checkpoint=checkpoint,
                balance=[len(model) + 1])
    torch.manual_seed(7)
    pipe.step(x, y, loss_fn, schedule)
    assert_same_grads(model, reference)
    assert watch.seen and all(seen == (True, None) for seen in watch.seen), watch.seen


class FakeCudaEvent:
    """A CUDA event on a fake device clock: each record takes the clock's next tick."""

    clock_ms = 0.0
    synchronized = 0

    def __init__(self, enable_timing: bool = False):
        assert enable_timing
        self.at: float | None = None

    def record(self, stream) -> None:
        assert stream == ("stream of", torch.device("cuda", 0))
        FakeCudaEvent.clock_ms += 10.0
        self.at = FakeCudaEvent.clock_ms

    def synchronize(self) -> None:
        FakeCudaEvent.synchronized += 1

    def elapsed_time(self, end: "FakeCudaEvent") -> float:
        return end.at - self.at


def test_cuda_actions_are_timed_by_events_with_one_sync_per_step(monkeypatch):
    """On CUDA each action's start and end are events on the stream, read once at the end
    of the step: a sync when the stopwatch starts (to place the stream on the shared
    clock) and one when the events are read, none per action. The old executors
    synchronised the stream after every action."""
    monkeypatch.setattr(torch.cuda, "Event", FakeCudaEvent)
    monkeypatch.setattr(FakeCudaEvent, "clock_ms", 0.0)
    monkeypatch.setattr(FakeCudaEvent, "synchronized", 0)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: ("stream of", device))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: pytest.fail("host sync"))
    host = iter([100.0])
    watch = Stopwatch(1, torch.device("cuda", 0), clock=lambda: next(host))  # zero at 10 ms
    actions = [Action(0, "F", 0), Action(0, "B", 0), Action(0, "F", 1)]
    for action in actions:
        with watch.timing(action):
            pass
    assert FakeCudaEvent.synchronized == 1
    events = watch.events()
    assert FakeCudaEvent.synchronized == 2
    # events at 20/30, 40/50, 60/70 ms of the device clock: 10 ms after its zero and on
    assert [(e.rank, e.action) for e in events] == [(1, a) for a in actions]
    assert [t for e in events for t in (e.start, e.end)] == pytest.approx(
        [100.01, 100.02, 100.03, 100.04, 100.05, 100.06])
